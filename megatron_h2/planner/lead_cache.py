"""Tables gathered at the option leads of a bound call, kept for the next call with the same
leads (:class:`~megatron_h2.planner.bounds.BatchShape`'s unused-type segments, stage caps and
capacities at each option's grid lead).

The option columns of a chip type (:mod:`.option_columns`) are built once per grid with a
read-only array of leads, which the bound calls of every suffix with those columns pass again:
what is gathered at those leads (for one set of unused types) is the same array each time. It
is kept on the shape under the array's identity (the array is kept too, so the identity is not
reused) until the probe grid changes; a writeable array of leads is gathered anew each call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable

    import numpy as np

    from megatron_h2.planner.bounds import BatchShape

_KEY = "_lead_cache"
"""Where a shape keeps the tables: (the probe grid's prefix table, dict)."""


def at_leads(shape: BatchShape, leads: np.ndarray, name: Hashable, build: Callable[[], Any]) -> Any:
    """``build()`` (a table gathered at ``leads``, named ``name``), kept per grid when
    ``leads`` is read-only."""
    if leads.flags.writeable:
        return build()
    cached = shape.__dict__.get(_KEY)
    if cached is None or cached[0] is not getattr(shape, "prefix", None):  # a new grid
        cached = (getattr(shape, "prefix", None), {})
        shape.__dict__[_KEY] = cached
    table: dict[tuple[int, Hashable], tuple[np.ndarray, Any]] = cached[1]
    key = (id(leads), name)
    item = table.get(key)
    if item is None or item[0] is not leads:
        item = (leads, build())
        table[key] = item
    return item[1]
