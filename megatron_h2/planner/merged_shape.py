"""Stage kinds that differ only in their expert-parallel degree, merged for the branch and bound.

A mixture-of-experts model multiplies the stage kinds of a batch shape by the EP degrees each
(chip type, TP, DP) can take (every divisor of the experts that divides DP), and the branch and
bound's tables, options and tree grow with them. :class:`MergedShape` searches the pipeline
structure over *merged* kinds instead, one per (chip type, TP, DP), whose bound tables are a
relaxation of all their EP degrees: per-layer times, fills, edges and syncs the least over the
degrees, memory caps the largest (per recompute mode and warm-up), so every bound of a merged
suffix is at most the bound of each EP choice under it and nothing that could win is pruned.
When a merged pipeline closes, :meth:`MergedShape.exact_leaves` expands it into every choice of
EP degree per block, each bounded with its exact tables (:attr:`MergedShape.exact`, the same
batch shape over the unmerged kinds) and solved exactly only if it may still win. The search
stays exhaustive over the same plan space, with the same plans.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from megatron_h2.planner.bounds import BatchShape, Kind

Suffix = tuple[tuple[int, int], ...]


class MergedShape(BatchShape):
    """A batch shape whose kinds are the (chip type, TP, DP) triples of :attr:`exact`'s kinds,
    each a relaxation over its EP degrees (:attr:`members`: the exact kinds it stands for)."""

    def __init__(self, *args: Any, lazy: bool = False, **kwargs: Any) -> None:
        """``args``, ``kwargs``: :class:`BatchShape`'s (cost, global batch, micro-batch size,
        schedule, chunks, DP degree, ``only``)."""
        self.exact = BatchShape(*args, lazy=True, **kwargs)
        super().__init__(*args, lazy=True, **kwargs)
        members: list[list[int]] = []
        for index, kind in enumerate(self.exact.kinds):
            first = self.exact.kinds[members[-1][0]] if members else None
            if first is not None and (first.chip, first.tp, first.dp) == (
                kind.chip, kind.tp, kind.dp
            ):  # fmt: skip
                members[-1].append(index)
            else:
                members.append([index])
        self.members = tuple(tuple(group) for group in members)
        merged = []
        for group in self.members:
            k = self.exact.kinds[group[0]]
            merged.append(
                Kind(k.chip, k.name, k.tp, k.dp, k.max_stages, None,  # type: ignore[arg-type]
                     k.micro_batches, k.factor, ep=0)  # no costs, no EP: a relaxation
            )  # fmt: skip
        self._set_kinds(merged)
        if not lazy:
            self.prepare()

    def cheap_bound(self, floor: float) -> float:
        """:meth:`BatchShape.cheap_bound` over the exact kinds (it takes the least over all)."""
        return self.exact.cheap_bound(floor)

    def _tables(self) -> None:
        """The exact kinds' tables, each reduced over the EP degrees of a merged kind in the
        direction that only lowers bounds (least times and syncs, largest caps)."""
        exact = self.exact
        exact._tables()
        exact.leads = exact._lead_grid()
        exact.prepared = True
        starts = [group[0] for group in self.members]

        def least(values: np.ndarray) -> np.ndarray:
            return np.minimum.reduceat(values, starts, axis=0)

        for name in ("steady", "tail_share", "embedding_min", "w_max"):
            setattr(self, name, getattr(exact, name))
        self.unit, self.fill_unit = least(exact.unit), least(exact.fill_unit)
        self.mem_caps = np.maximum.reduceat(exact.mem_caps, starts, axis=0)
        self.head_need, self.embedding_need = least(exact.head_need), least(exact.embedding_need)
        self.head_time, self.embedding_time = least(exact.head_time), least(exact.embedding_time)
        self.sync_one, self.head_tail = least(exact.sync_one), least(exact.head_tail)
        self.embedding_tail, self.tail_floor = least(exact.embedding_tail), exact.tail_floor
        self.type_embedding_tail = exact.type_embedding_tail  # the least over the type's kinds
        self.sync_inverse = np.maximum.reduceat(exact.sync_inverse, starts, axis=0)
        self._sync_floats = (self.sync_one.tolist(), self.sync_inverse.tolist())
        self.type_sync_inverse = exact.type_sync_inverse  # the largest over the type's kinds

    def mode_caps(
        self, kind: int, stages: int, stage: int, warmup: int | None = None
    ) -> tuple[int, int, int]:
        """The largest of the exact kinds' :meth:`BatchShape.mode_caps` per recompute mode."""
        caps = [self.exact.mode_caps(k, stages, stage, warmup) for k in self.members[kind]]
        return (max(c[0] for c in caps), max(c[1] for c in caps), max(c[2] for c in caps))

    def _placed_stage_caps(
        self, kind: int, warmup: int, position: int, stages: int
    ) -> tuple[int, int, int]:
        caps = [self.exact._placed_stage_caps(k, warmup, position, stages)
                for k in self.members[kind]]  # fmt: skip
        return (max(c[0] for c in caps), max(c[1] for c in caps), max(c[2] for c in caps))

    def exact_view(self) -> BatchShape:
        """:attr:`exact` on this shape's probe grid (for leaf bounds over exact kinds)."""
        exact = self.exact
        if exact._grid_key != self._grid_key:
            exact._grid_key, exact.grid = self._grid_key, self.grid
            exact.grid_is_max, exact.w_floor = self.grid_is_max, self.w_floor
            exact._timed, exact._placed, exact._closed = {}, {}, {}
        return exact

    def exact_suffixes(self, suffix: Suffix) -> list[Suffix]:
        """Every choice of one exact kind (EP degree) per block of a merged ``suffix``."""
        choices = [self.members[kind] for kind, _ in suffix]
        counts = [count for _, count in suffix]
        return [tuple(zip(combo, counts)) for combo in itertools.product(*choices)]
