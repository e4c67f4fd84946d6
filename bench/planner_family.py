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

import math
import random
from dataclasses import dataclass

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


def random_model(rng: random.Random) -> tuple[str, ModelConfig]:
    name, layers, hidden, ffn, heads = rng.choice(MODELS)
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


def member(seed: int, size: int) -> Member:
    """The family member of ``seed`` at about ``size`` chips (deterministic)."""
    rng = random.Random(f"{seed}-{size}")
    types = 8 if size >= 100_000 else rng.randint(2, 8)
    cluster = random_cluster(rng, size, types)
    distributed = rng.random() < 0.5
    memory = sum(c.count * c.memory_gib * 2**30 for c in cluster.chips)
    for _ in range(100):
        name, model = random_model(rng)
        config = CostConfig(use_distributed_optimizer=distributed)
        weights = model.num_layers * model.layer_params_per_chip(1) * config.bytes_per_param(1)
        if weights <= memory / 2:
            break
    global_batch = 2 ** rng.randint(8, 14)
    cost = CostModel(cluster, model, config)
    chips = sum(c.count for c in cluster.chips)
    label = (
        f"seed {seed}: {chips:,} chips, {types} types, {name} vocab {model.vocab_size:,}"
        f" seq {model.seq_length}, batch {global_batch}{', ZeRO' if distributed else ''}"
    )
    return Member(label, cost, global_batch, chips)
