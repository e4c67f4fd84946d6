"""Which batch shapes the search's short dives go into first (:mod:`.search`).

The dives find the first plans, whose step times prune everything above them, so they should
go where good plans are. A lazy batch shape (zero-bubble or interleaved) is known until it is
prepared only by a cheap bound from the 1F1B shape of the same micro-batch size and DP degree
(:meth:`~megatron_h2.planner.bounds.BatchShape.cheap_bound`), which can lie far below its
prepared root bound: on the 1,024-chip 8-type family member the interleaved ``V = 4`` shapes
of micro-batch 1 came first by their cheap bounds (0.82-0.83 s) while prepared their roots are
1.55-1.86 s, and the zero-bubble shape of micro-batch 1 at DP 4 (cheap 0.91, prepared 1.03 s),
which holds the best plans, came eleventh. :func:`dive_order` therefore orders the shapes
lazily: the lowest bound first, and a shape that is not prepared yet is prepared and put back
by its prepared root bound. Only the order of the dives changes (each shape is prepared at
most once, as the search would before searching it anyway); nothing is bounded or pruned
differently, so the search stays exhaustive.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator

from megatron_h2.planner.bounds import BatchShape
from megatron_h2.planner.partition import INF

__all__ = ["dive_grids", "dive_order"]


def dive_order(
    shapes: list[BatchShape],
    cutoff: Callable[[], float],
    late: Callable[[], bool],
    sharpen: Callable[[BatchShape], None] | None = None,
) -> Iterator[BatchShape]:
    """Prepared shapes of ``shapes``, lowest prepared root bound first (the unprepared ones
    are prepared when their cheap bound comes first), while the lowest bound is below
    ``cutoff()`` and ``late()`` is False; the caller dives into each shape yielded. Once there
    is a cutoff, a shape's root is first raised by ``sharpen`` (what the search would do
    before searching it) and the shape put back by its new bound."""
    heap = [(shape.root_bound(), index, shape) for index, shape in enumerate(shapes)]
    heapq.heapify(heap)
    sharpened: set[int] = set()
    while heap and not late():
        bound, index, shape = heapq.heappop(heap)
        if bound >= cutoff():
            return
        if not shape.prepared:
            shape.prepare()
            heapq.heappush(heap, (shape.root_bound(), index, shape))
            continue
        if sharpen is not None and cutoff() < INF and index not in sharpened:
            sharpened.add(index)
            sharpen(shape)
            heapq.heappush(heap, (shape.root_bound(), index, shape))
            continue
        yield shape


def dive_grids(shape: BatchShape, best: Callable[[], float]) -> Iterator[float]:
    """The tops of the probe grids for the dives into ``shape``: the best step time found so
    far (``best()``; the K-th best, the search's threshold, can be much higher), or, before
    any plan is found, the shape's largest work, then again the best plan that dive found."""
    first = best()
    yield first if first < INF else shape.w_max
    if first == INF and best() < INF:
        yield best()
