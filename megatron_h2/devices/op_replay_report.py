"""What a precision capture found: summary, first divergence, tables, JSON and a plot by layer.

See :mod:`megatron_h2.devices.op_replay` for how the records are made.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_h2.devices.op_replay import TOLERANCES, OpRecord


def _fmt(value: float | None, spec: str = ".2e") -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf"
    return format(value, spec)


def describe(record: OpRecord) -> str:
    """One line: ``#12 aten.mm.default (backward) in decoder.layers.0.mlp: abs ..., ...``."""
    where = record.module or "(outside every module)"
    return (f"#{record.index} {record.op} ({record.phase}) in {where}: {record.dtype} "
            f"{record.shape[0] if record.shape else []}, max abs {_fmt(record.max_abs)}, "
            f"max rel {_fmt(record.max_rel)}, {_fmt(record.max_ulp, '.3g')} ulp, "
            f"{_fmt(record.tol_ratio, '.3g')} x tolerance [{record.status}]"
            f"{' - ' + record.note if record.note else ''}")


@dataclass
class PrecisionReport:
    """Records of one capture plus what was compared with what (``meta``)."""

    records: list[OpRecord]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.records = sorted(self.records, key=lambda r: r.index)

    @property
    def compared(self) -> list[OpRecord]:
        return [r for r in self.records if r.status != "skipped"]

    @property
    def failed(self) -> list[OpRecord]:
        return [r for r in self.records if r.status == "fail"]

    @property
    def first_divergence(self) -> OpRecord | None:
        """The first operator, in execution order, beyond its tolerance (None: all within)."""
        failed = self.failed
        return failed[0] if failed else None

    @property
    def worst(self) -> OpRecord | None:
        """The compared operator closest to (or furthest beyond) its tolerance."""
        rated = [r for r in self.compared if r.tol_ratio is not None]
        return max(rated, key=lambda r: r.tol_ratio) if rated else None

    def summary(self) -> dict[str, Any]:
        first, worst = self.first_divergence, self.worst
        return {"operators": len(self.records), "compared": len(self.compared),
                "failed": len(self.failed),
                "skipped": len(self.records) - len(self.compared),
                "first_divergence": None if first is None else describe(first),
                "worst": None if worst is None else describe(worst)}

    def by_layer(self) -> dict[str, dict[str, OpRecord]]:
        """``{layer: {phase: the record with the largest error/tolerance ratio}}``."""
        out: dict[str, dict[str, OpRecord]] = defaultdict(dict)
        for r in self.compared:
            best = out[r.layer].get(r.phase)
            if r.tol_ratio is not None and (best is None or r.tol_ratio > best.tol_ratio):
                out[r.layer][r.phase] = r
        return dict(out)

    def by_op(self) -> list[dict[str, Any]]:
        """Per operator name: count, failures and worst errors, most calls first."""
        groups: dict[str, list[OpRecord]] = defaultdict(list)
        for r in self.records:
            groups[r.op].append(r)
        rows = []
        for op, recs in groups.items():
            done = [r for r in recs if r.status != "skipped"]

            def worst(key: str, done: list[OpRecord] = done) -> float | None:
                values = [getattr(r, key) for r in done if getattr(r, key) is not None]
                return max(values) if values else None

            rows.append({"op": op, "calls": len(recs), "compared": len(done),
                         "failed": sum(r.status == "fail" for r in recs),
                         "max_abs": worst("max_abs"), "max_rel": worst("max_rel"),
                         "max_ulp": worst("max_ulp"), "tol_ratio": worst("tol_ratio"),
                         "note": next((r.note for r in recs if r.status == "skipped"), "")})
        return sorted(rows, key=lambda row: (-row["calls"], row["op"]))

    def format(self) -> str:
        """The table printed by tools/precision_check.py."""
        s = self.summary()
        lines = [", ".join(f"{k} {v}" for k, v in self.meta.items() if not isinstance(v, dict)),
                 f"{s['operators']} operator calls: {s['compared']} compared, {s['failed']} "
                 f"beyond tolerance, {s['skipped']} not comparable",
                 f"{'operator':<58} {'calls':>5} {'fail':>4} {'max abs':>9} {'max rel':>9} "
                 f"{'ulp':>7} {'x tol':>7}"]
        for row in self.by_op():
            lines.append(f"{row['op'][:58]:<58} {row['calls']:>5} {row['failed']:>4} "
                         f"{_fmt(row['max_abs']):>9} {_fmt(row['max_rel']):>9} "
                         f"{_fmt(row['max_ulp'], '.3g'):>7} {_fmt(row['tol_ratio'], '.3g'):>7}"
                         f"{'  ' + row['note'] if row['note'] and not row['compared'] else ''}")
        lines.append("worst by layer (error / tolerance):")
        for layer, phases in self.by_layer().items():
            parts = [f"{phase} {_fmt(r.tol_ratio, '.3g')} ({r.op})"
                     for phase, r in sorted(phases.items())]
            lines.append(f"  {layer:<10} " + "; ".join(parts))
        first = self.first_divergence
        lines.append(f"first divergence: {describe(first)}" if first is not None
                     else "first divergence: none (every compared operator is within "
                          "tolerance)")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {**self.meta,
                "tolerances": {str(k).removeprefix("torch."): {"rtol": v.rtol, "atol": v.atol}
                               for k, v in TOLERANCES.items()},
                "summary": self.summary(),
                "first_divergence": None if self.first_divergence is None
                else self.first_divergence.to_dict(),
                "operators": [r.to_dict() for r in self.records]}

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1, allow_nan=True) + "\n")

    def plot(self, path: str | Path) -> None:
        """PNG: worst max rel error and error / tolerance per layer, forward and backward."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        layers = _ordered_layers(self.by_layer())
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, key, title in ((axes[0], "max_rel", "worst max rel error"),
                               (axes[1], "tol_ratio", "worst error / tolerance")):
            for phase, marker in (("forward", "o-"), ("backward", "s--"),
                                  ("optimizer", "^:")):
                ys = [_worst(self.compared, lay, phase, key) for lay in layers]
                if any(y is not None for y in ys):
                    ax.plot(range(len(layers)), [y if y else float("nan") for y in ys],
                            marker, label=phase)
            if key == "tol_ratio":
                ax.axhline(1.0, color="red", lw=1, label="tolerance")
            ax.set_yscale("log")
            ax.set_xticks(range(len(layers)), layers, rotation=45, ha="right")
            ax.set_title(title)
            ax.legend()
        fig.suptitle(" | ".join(f"{k} {v}" for k, v in self.meta.items()
                                if k in ("device", "dtype", "reference", "reference_dtype")))
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


def _worst(records: list[OpRecord], layer: str, phase: str, key: str) -> float | None:
    values = [getattr(r, key) for r in records
              if r.layer == layer and r.phase == phase and getattr(r, key) is not None]
    values = [v for v in values if v > 0 and math.isfinite(v)]
    return max(values) if values else None


def _ordered_layers(layers: dict[str, Any]) -> list[str]:
    def key(name: str) -> tuple[int, int]:
        if name == "embedding":
            return (0, 0)
        if name.startswith("layer "):
            return (1, int(name.split()[1]))
        return (2, 0) if name == "head" else (3, 0)

    return sorted(layers, key=key)
