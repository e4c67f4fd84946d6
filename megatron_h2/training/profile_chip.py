"""Measure one chip: forward and backward time of one transformer layer, the embedding and the
head, per micro-batch size, written as the planner's profile table (see
:mod:`megatron_h2.planner.profile` for the format).

Times are medians over repetitions after warm-up, at TP 1 and without recompute, on the device
this process runs on; the cost model scales them for TP, recompute and emulated slowdown. With
``bf16`` the parts run as ``--bf16`` trains: bf16 weights and activations, no autocast.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import yaml

from megatron_h2.config import ModelConfig
from megatron_h2.devices import Accelerator
from megatron_h2.models.gpt import GPTModel, cast_parameters, init_parameters

PROFILE_MODEL_KEYS = ("hidden_size", "ffn_hidden_size", "num_attention_heads",
                      "num_query_groups", "seq_length", "vocab_size")


@dataclass(frozen=True)
class PartTimes:
    forward_ms: float
    backward_ms: float


def _timed_ms(acc: Accelerator, fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    acc.synchronize()
    return (time.perf_counter() - start) * 1e3


def _time_part(acc: Accelerator, model: GPTModel, make_input: Callable[[], dict],
               warmup: int, reps: int) -> PartTimes:
    """Forward alone and forward + backward, measured alternately; backward = the difference
    of the medians."""
    model.train()
    inputs = make_input()

    def forward() -> torch.Tensor:
        return model(**inputs).float().sum()

    def forward_only() -> None:
        with torch.no_grad():
            forward()

    def forward_backward() -> None:
        forward().backward()
        model.zero_grad(set_to_none=True)
        for value in inputs.values():
            if isinstance(value, torch.Tensor) and value.grad is not None:
                value.grad = None

    for _ in range(warmup):
        forward_backward()
    fwd, both = [], []
    for _ in range(reps):
        fwd.append(_timed_ms(acc, forward_only))
        both.append(_timed_ms(acc, forward_backward))
    f = statistics.median(fwd)
    return PartTimes(forward_ms=f, backward_ms=max(statistics.median(both) - f, 0.0))


def _input_makers(
    cfg: ModelConfig, mbs: int, dev: torch.device, dtype: torch.dtype
) -> tuple[Callable[[], dict], Callable[[], dict], Callable[[], dict]]:
    """Fresh inputs of one micro-batch for the layer, the embedding and the head."""
    s, h, v = cfg.seq_length, cfg.hidden_size, cfg.vocab_size

    def hidden() -> dict:
        return {"hidden_states": torch.randn(mbs, s, h, device=dev, dtype=dtype,
                                             requires_grad=True)}

    def tokens() -> dict:
        return {"tokens": torch.randint(0, v, (mbs, s), device=dev)}

    def labelled() -> dict:
        return {**hidden(), "labels": torch.randint(0, v, (mbs, s), device=dev)}

    return hidden, tokens, labelled


def profile_model(config: ModelConfig, acc: Accelerator, micro_batch_sizes: list[int],
                  bf16: bool = False, warmup: int = 2, reps: int = 7,
                  log: Callable[[str], None] = print) -> dict[int, dict[str, float]]:
    """``{micro_batch_size: {layer_forward_ms, layer_backward_ms, embedding_..., head_...}}``."""
    cfg = replace(config, num_layers=1, recompute="none")
    dev = acc.device
    layer = GPTModel(cfg, acc.kernels, (0, 1), pre_process=False, post_process=False).to(dev)
    embed = GPTModel(cfg, acc.kernels, (0, 0), pre_process=True, post_process=False).to(dev)
    head = GPTModel(cfg, acc.kernels, (0, 0), pre_process=False, post_process=True).to(dev)
    dtype = torch.bfloat16 if bf16 else torch.float32
    for part in (layer, embed, head):
        init_parameters(part, cfg, seed=0)
        cast_parameters(part, dtype)
    table: dict[int, dict[str, float]] = {}
    for mbs in micro_batch_sizes:
        hidden, tokens, labelled = _input_makers(cfg, mbs, dev, dtype)
        row = {}
        for name, model, make in (("layer", layer, hidden), ("embedding", embed, tokens),
                                  ("head", head, labelled)):
            t = _time_part(acc, model, make, warmup, reps)
            row[f"{name}_forward_ms"] = round(t.forward_ms, 4)
            row[f"{name}_backward_ms"] = round(t.backward_ms, 4)
        log(f"micro-batch {mbs}: layer forward {row['layer_forward_ms']:.2f} ms, backward "
            f"{row['layer_backward_ms']:.2f} ms | embedding {row['embedding_forward_ms']:.2f}/"
            f"{row['embedding_backward_ms']:.2f} ms | head {row['head_forward_ms']:.2f}/"
            f"{row['head_backward_ms']:.2f} ms")
        table[mbs] = row
    return table


def write_profile(path: str | Path, config: ModelConfig, chips: list[str],
                  table: dict[int, dict[str, float]], note: str) -> None:
    """Write the profile table YAML (the same measurement under every name in ``chips``)."""
    data = {"model": {k: getattr(config, k) for k in PROFILE_MODEL_KEYS},
            "chips": {name: {"micro_batch_sizes": {k: dict(v) for k, v in table.items()}}
                      for name in chips}}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(f"# {note}\n" + yaml.safe_dump(data, sort_keys=False))
