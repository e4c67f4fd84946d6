"""Calibrating the planner to one machine, and checking it against a run (no torch).

* :func:`fitted_gb_per_s`: the bandwidths that make the cost model's formulas, with their
  default latencies, give measured transfer times (an all-reduce of ``B`` bytes over 2 chips
  takes ``2 x latency + B / (bw x comm_efficiency)``, a pipeline transfer ``latency +
  B_bf16 / (bw x comm_efficiency)``);
* :func:`calibrated_cluster`: a cluster description with those bandwidths;
* :func:`steady_step_ms`: a run's measured step time, from its ``--log-jsonl``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_h2.errors import ConfigError
from megatron_h2.planner.cost_model import CostConfig


@dataclass(frozen=True)
class LinkTimes:
    """Measured transfer times between two processes of this machine."""

    allreduce_s: float
    """All-reduce of ``allreduce_bytes`` (fp32 gradients) over 2 ranks."""
    allreduce_bytes: int
    p2p_s: float
    """One point-to-point transfer of ``p2p_bytes`` (fp32 activations, as the runtime sends)."""
    p2p_bytes: int

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LinkTimes:
        return cls(float(data["allreduce_s"]), int(data["allreduce_bytes"]),
                   float(data["p2p_s"]), int(data["p2p_bytes"]))


def fitted_gb_per_s(links: LinkTimes, config: CostConfig | None = None) -> tuple[float, float]:
    """``(collective, point_to_point)`` bandwidths in GB/s that reproduce ``links``.

    The runtime sends fp32 activations, twice the bf16 bytes the cost model counts, so the
    point-to-point figure is per modelled byte (it also absorbs the per-message cost).
    """
    cfg = config or CostConfig()
    allreduce = links.allreduce_bytes / max(links.allreduce_s - 2 * cfg.collective_latency_s,
                                            1e-9)
    modelled = links.p2p_bytes / 2  # fp32 on the wire, bf16 in the model
    p2p = modelled / max(links.p2p_s - cfg.p2p_latency_s, 1e-9)
    return (round(allreduce / cfg.comm_efficiency / 1e9, 4),
            round(p2p / cfg.comm_efficiency / 1e9, 4))


def calibrated_cluster(cluster: Mapping[str, Any], links: LinkTimes,
                       config: CostConfig | None = None,
                       host_cores: float | None = None) -> dict[str, Any]:
    """A copy of the cluster YAML mapping whose bandwidths are those measured on this machine.

    For CPU emulation, where every chip is a process of this machine and every link is gloo
    over loopback: DP groups get the all-reduce figure, pipeline transfers between chip types
    the point-to-point one, those within a chip type the inter-node (all-reduce) figure, which
    matters little: a step waits for each link only while the pipeline fills and drains. Every
    chip becomes its own node (``chips_per_node: 1``), so plans have no tensor parallelism:
    TP all-reduces among processes that share the cores (each waits for a core) are neither
    measured here nor described by the cost model's TP formula. ``host_cores`` (the cores the
    emulating processes got together, measured) goes into the copy as the cluster's
    ``host_cores``.
    """
    collective, p2p = fitted_gb_per_s(links, config)
    data = copy.deepcopy(dict(cluster))
    if not isinstance(data.get("chips"), Mapping):
        raise ConfigError("the cluster to calibrate has no 'chips' mapping")
    for chip in data["chips"].values():
        chip["chips_per_node"] = 1
        chip["intra_node_gb_per_s"] = collective
        chip["inter_node_gb_per_s"] = collective
    if "cross_chip_gb_per_s" in data or len(data["chips"]) > 1:
        data["cross_chip_gb_per_s"] = p2p
    if host_cores is not None:
        data["host_cores"] = host_cores
    return data


def steady_rows(metrics_jsonl: str | Path, skip: int) -> list[dict]:
    """The ``--log-jsonl`` rows of the iterations after the first ``skip`` (warm-up) of a run
    logged every iteration; rows that include a validation pass are left out (their time
    includes it)."""
    rows = [json.loads(line) for line in Path(metrics_jsonl).read_text().splitlines()
            if line.strip()]
    return [r for r in rows
            if "iteration_ms" in r and r["iteration"] > skip and "val_loss" not in r]


def steady_step_ms(metrics_jsonl: str | Path, skip: int) -> list[float]:
    """``iteration_ms`` of :func:`steady_rows`."""
    return [float(r["iteration_ms"]) for r in steady_rows(metrics_jsonl, skip)]

