"""The root bound of a batch shape with its end-of-step term and links coupled with the
steady term (:meth:`~megatron_h2.planner.bounds.BatchShape._coupled_root`), kept apart so
that bounds.py stays short."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from megatron_h2.planner.joint_root import joint_root_terms
from megatron_h2.planner.own_root import joint_root
from megatron_h2.planner.sync_coupling import least_sync

if TYPE_CHECKING:
    from megatron_h2.planner.bounds import BatchShape


def coupled_root(shape: BatchShape, levels: bool = False, joint: bool = False) -> float:
    """The root bound with the end-of-step term and the links coupled with the steady
    term, on probes from the root's up to four times it: where the slowest steady term is in
    ``(g_j, g_j+1]``, the layers fit the capacity at ``g_j+1`` (every chip type's block as
    if it ended the pipeline), so the end-of-step term is at least :func:`least_sync` of the
    types' capacities and sync inverses there, the stages at least the layers over the
    largest single-stage capacity there, each but one with a link, and the summed fill at
    least the layers filled into the cheapest capacity there (its ``_segment_fill``, time caps
    included; with the links, jointly over the types' kinds: :mod:`.own_root`,
    :mod:`.uniform_root`; one DP with ``joint``: :mod:`.joint_root` too); above the top probe,
    the uncoupled terms."""
    cells = root_cells(shape)
    if cells is None:
        return 0.0
    probes, caps, most, tail, fill, terms, beyond = cells
    if joint:  # one DP, refined: each type one block of one kind or none (.joint_root)
        terms = np.maximum(terms, joint_root_terms(shape, probes, tail, fill))
    # each type one kind or none: the fill and links joint (with ``levels``: own_root.py)
    return joint_root(shape, probes, caps, most, tail, terms, beyond, levels)


def root_cells(shape: BatchShape) -> tuple[Any, ...] | None:
    """The coupled root's probes (97, from the root's steady floor up to four times it), the
    capacities there (kind x probe x warm-up) and each kind's most (kind x probe), per probe
    interval the end-of-step floor, the summed fill and the loose root terms, and the terms
    above the top probe. None where the probes span nothing."""
    floor = max(shape.w_floor, float(shape.head_need.min()))
    if not (top := min(shape.w_max, 4.0 * floor)) > floor:
        return None
    probes = np.geomspace(floor, top, 97)
    caps = shape.capacity(probes)  # kind x probe x warm-up
    most = shape._most_layers(caps)
    held = [most[shape.kinds_of[t]].max(axis=0) for t in shape.types]
    rates = [shape.type_sync_inverse[t] for t in shape.types]
    sync = least_sync(held, rates, float(shape.layers))[1:]
    stages = np.ceil(shape.layers / np.maximum(caps[:, 1:, :].max(axis=(0, 2)), 1.0) - 1e-9)
    links = np.maximum(stages - 1.0, 0.0) * min(shape.type_link.values())
    fill = np.maximum(shape._segment_fill(most)[1:], shape.root_fill)  # at g_j+1
    tail = np.maximum(sync, shape.tail_floor)
    terms = shape._root_terms(probes[:-1], tail, np.maximum(links, shape.root_links), fill)
    beyond = float(shape._root_terms(top, shape.tail_floor, shape.root_links))
    return probes, caps, most, tail, fill, terms, beyond
