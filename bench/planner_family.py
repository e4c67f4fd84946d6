"""A seeded family of random clusters and models for the planner bench (bench_planner.py
--family): nothing in examples/ resembles them.

Each member: 2-8 chip types (8 at 100,000 chips) with datasheet-like figures drawn from the
ranges real chips span (16-192 GB, 50-2,500 dense BF16 TFLOPS log-uniform, 4 or 8 chips per
node, 50-900 GB/s within a node and 10-100 GB/s between nodes, log-uniform), uneven counts that
add up to about the cluster size, and a dense LLaMA-style model of 7B-405B parameters (MHA or
GQA), a 32k-256k vocabulary, sequence 2k-8k and a global batch of 256-16,384; the distributed
optimizer on or off. A model is drawn again while its weights and optimizer state would take
more than half the cluster's memory (a member where nothing can fit says nothing about speed).
"""

from __future__ import annotations

import importlib
import math
import random
import time
from dataclasses import dataclass, replace
from types import SimpleNamespace

from megatron_h2.config import ModelConfig
from megatron_h2.planner import Cluster, CostConfig, CostModel, model_from_dict
from megatron_h2.planner.cluster import ChipType

MEMORY_GB = (16, 24, 32, 40, 48, 64, 80, 94, 96, 128, 141, 192)
MODELS = (  # name, layers, hidden, FFN, heads
    ("7B", 32, 4096, 11008, 32),
    ("13B", 40, 5120, 13824, 40),
    ("34B", 48, 8192, 22016, 64),
    ("70B", 80, 8192, 28672, 64),
    ("175B", 96, 12288, 49152, 96),
    ("405B", 126, 16384, 53248, 128),
)
VOCABS = (32000, 50257, 65536, 128256, 152064, 256000)
LLAMA = {
    "swiglu": True,
    "normalization": "RMSNorm",
    "position_embedding_type": "rope",
    "disable_bias_linear": True,
    "untie_embeddings_and_output_weights": True,
}


@dataclass(frozen=True)
class Member:
    """One cluster and model of the family, with what to call it in a table."""

    label: str
    cost: CostModel
    global_batch_size: int
    chips: int


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def random_cluster(rng: random.Random, size: int, types: int) -> Cluster:
    """``types`` chip types of about ``size`` chips in all (whole nodes, at least one each)."""
    weights = [rng.uniform(0.2, 1.0) for _ in range(types)]
    chips = []
    for index, weight in enumerate(weights):
        per_node = rng.choice((4, 8, 8))
        nodes = max(1, round(size * weight / sum(weights) / per_node))
        intra = _log_uniform(rng, 50, 900)
        chips.append(
            ChipType(
                f"T{index}",
                "cuda",
                nodes * per_node,
                per_node,
                round(_log_uniform(rng, 50, 2500)),
                rng.choice(MEMORY_GB),
                round(intra, 1),
                round(min(_log_uniform(rng, 10, 100), intra), 1),
            )
        )
    return Cluster(tuple(chips), round(_log_uniform(rng, 10, 50), 1))


def random_model(rng: random.Random, size: str | None = None) -> tuple[str, ModelConfig]:
    """A random model (of ``size``, e.g. ``"70B"``, when given)."""
    name, layers, hidden, ffn, heads = rng.choice(MODELS)
    if size is not None:
        name, layers, hidden, ffn, heads = next(m for m in MODELS if m[0] == size)
    gqa = rng.random() < 0.5
    data = {
        "num_layers": layers,
        "hidden_size": hidden,
        "ffn_hidden_size": ffn,
        "num_attention_heads": heads,
        "seq_length": rng.choice((2048, 4096, 8192)),
        "vocab_size": rng.choice(VOCABS),
        **LLAMA,
    }
    if gqa:
        data["group_query_attention"] = True
        data["num_query_groups"] = 8
    return f"{name} {'GQA' if gqa else 'MHA'}", model_from_dict(data)


def member(seed: int, size: int, types: int | None = None, model: str | None = None) -> Member:
    """The family member of ``seed`` at about ``size`` chips (deterministic), with ``types``
    chip types when given (the first ``types`` of one cluster drawn with 8 per seed, whatever
    the size, so that sizes and type counts compare) and a model of ``model`` parameters (e.g.
    ``"70B"``) when given."""
    rng = random.Random(f"{seed}-{size}" if types is None else f"{seed}-scaling")
    drawn = 8 if size >= 100_000 or types is not None else rng.randint(2, 8)
    cluster = random_cluster(rng, size, drawn)
    if types is not None:  # fewer types of the same cluster, scaled to the same size
        kept = cluster.chips[:types]
        scale = size / sum(c.count for c in kept)
        chips = tuple(
            replace(c, count=max(1, round(c.count * scale / c.chips_per_node)) * c.chips_per_node)
            for c in kept
        )
        cluster = Cluster(chips, cluster.cross_chip_gb_per_s)
    types = len(cluster.chips)
    distributed = rng.random() < 0.5
    memory = sum(c.count * c.memory_gib * 2**30 for c in cluster.chips)
    for _ in range(100):
        name, config_model = random_model(rng, model)
        config = CostConfig(use_distributed_optimizer=distributed)
        layers = config_model.num_layers
        weights = layers * config_model.layer_params_per_chip(1) * config.bytes_per_param(1)
        if weights <= memory / 2 or model is not None:
            break
    global_batch = 2 ** rng.randint(8, 14)
    cost = CostModel(cluster, config_model, config)
    chips = sum(c.count for c in cluster.chips)
    label = (
        f"seed {seed}: {chips:,} chips, {types} types, {name} vocab {config_model.vocab_size:,}"
        f" seq {config_model.seq_length}, batch {global_batch}{', ZeRO' if distributed else ''}"
    )
    return Member(label, cost, global_batch, chips)


def moe_member(seed: int, size: int = 1024) -> Member:
    """A mixture-of-experts member (bench_planner_moe.py --family): 2-4 chip types of about
    ``size`` chips, a model of the 7B/13B/34B shapes above with 8-64 experts of FFN 1/4-1 of
    the dense one, top-1 to top-8 routing (at most the experts), every layer MoE, every other
    one, or the first one to three dense and the rest MoE, a shared expert or none, the
    distributed optimizer on; drawn again while its weights would take more than half the
    cluster's memory."""
    rng = random.Random(f"moe-{seed}-{size}")
    cluster = random_cluster(rng, size, rng.randint(2, 4))
    memory = sum(c.count * c.memory_gib * 2**30 for c in cluster.chips)
    config = CostConfig(use_distributed_optimizer=True)
    for _ in range(100):
        name, layers, hidden, ffn, heads = rng.choice(MODELS[:3])
        experts = rng.choice((8, 16, 32, 64))
        topk = rng.randint(1, min(8, experts))
        dense = rng.choice((0, 0, 1, 3))
        freq: int | list[int] = rng.choice((1, 2)) if not dense else [0] * dense + [1] * (
            layers - dense)
        data = {"num_layers": layers, "hidden_size": hidden, "ffn_hidden_size": ffn,
                "num_attention_heads": heads, "seq_length": rng.choice((2048, 4096)),
                "vocab_size": rng.choice(VOCABS), "num_experts": experts,
                "moe_router_topk": topk, "moe_ffn_hidden_size": ffn // rng.choice((1, 2, 4)),
                "moe_layer_freq": freq, "moe_router_pre_softmax": topk == 1, **LLAMA}
        if rng.random() < 0.3:
            data["moe_shared_expert_intermediate_size"] = data["moe_ffn_hidden_size"]
        model = model_from_dict(data)
        expert = 3 * hidden * data["moe_ffn_hidden_size"]  # SwiGLU: three matrices
        moe_layer = model.layer_params - 3 * hidden * ffn + experts * expert
        per_layer = [moe_layer if model.is_moe_layer(i) else model.layer_params
                     for i in range(layers)]  # about: the memory test only
        if sum(per_layer) * config.bytes_per_param(1) <= memory / 2:
            break
    global_batch = 2 ** rng.randint(8, 10)
    cost = CostModel(cluster, model, config)
    pattern = "all MoE" if freq == 1 else ("every other MoE" if freq == 2 else f"{dense} dense")
    label = (f"moe seed {seed}: {len(cluster.chips)} types, {name} {experts} experts top-{topk}"
             f" ({pattern}), batch {global_batch}")
    return Member(label, cost, global_batch, sum(c.count for c in cluster.chips))


def use_cpu_clock() -> None:
    """Make the plan search's time limit count CPU seconds of this process, not wall seconds
    (the search reads its clock through its module's ``time``)."""
    module = importlib.import_module("megatron_h2.planner.search")
    module.time = SimpleNamespace(monotonic=time.process_time)
