"""The fill and links of an own-DP shape's root, bounded jointly over its chip types' choices.

Under own DP degrees (:class:`~megatron_h2.planner.bounds.BatchShape` with ``dp`` None) a chip
type is either unused or runs exactly one stage kind with all of its chips: ``n`` stages of that
kind (``n t d`` = its chip count), each holding at least one layer and, where the slowest folded
steady term is at most a probe ``g``, at most the kind's capacity there (its block as if it ended
the pipeline, :meth:`~megatron_h2.planner.bounds.BatchShape._most_layers`: an upper bound
wherever it sits). A block's links are at least its type's own link per stage but one plus one
to another type (:mod:`.block_links`). So the summed fill plus links of every plan is at least
the least, over the choices of one kind or none per type whose layers sum to ``L``, of
``sum (x_k fill_k + links(n_k))`` minus the largest cross-type link, plus
the edges' least fill: a multiple-choice knapsack over types and layer counts ``0 .. L``, solved
exactly by a small dynamic programme per probe (polynomial in the types, kinds and layers).

The root's loose form takes the fill (the cheapest capacity of every kind at once, a type's
kinds all counted) and the links (the fewest stages that hold the layers) apart; tied to the
kinds, a type's small DP degree brings its many stages' layers and links with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from megatron_h2.planner.block_links import block_links
from megatron_h2.planner.uniform_root import (
    least_over_types,
    level_fill_links,
    sync_levels,
    uniform_fill_links,
)

if TYPE_CHECKING:
    from megatron_h2.planner.bounds import BatchShape


def own_fill_links(shape: BatchShape, most: np.ndarray) -> np.ndarray:
    """Per probe, a lower bound on the summed fill (edges included) plus the links of every own-DP
    plan of ``shape`` whose stages hold at most ``most`` (kind x probe, whole units) layers each
    block: the knapsack of the module docstring; inf where no choice holds the layers."""
    layers, x = shape.layers, np.arange(shape.layers + 1)
    tables = []
    for chip in shape.types:
        table = np.full((most.shape[1], layers + 1), np.inf)  # probe x units
        for kind in shape.kinds_of[chip]:
            stages = shape.kinds[kind].max_stages
            unit, links = float(shape.fill_unit[kind]), block_links(shape, chip, stages)
            held = np.minimum(most[kind], layers)[:, None]
            cost = np.where((x >= stages) & (x <= held), x * unit + links, np.inf)
            np.minimum(table, cost, out=table)
        tables.append(table)
    return least_over_types(shape, tables)


CHUNK = 8
"""Probe intervals whose joint terms are computed at once (:func:`joint_root`)."""


def joint_root(
    shape: BatchShape,
    probes: np.ndarray,
    caps: np.ndarray,
    most: np.ndarray,
    tail: np.ndarray,
    loose: np.ndarray,
    beyond: float,
    levels: bool = False,
) -> float:
    """The root bound: the least over the probe intervals ``(g_j, g_j+1]`` (``probes[:-1]``) of
    the larger of their ``loose`` terms and their terms with the fill and links joint
    (:func:`joint_root_terms`), and ``beyond`` (above the top probe). The joint terms are
    computed only where they may set it: lowest loose term first, :data:`CHUNK` intervals at a
    time, until the next loose term is no lower than the least so far (the same value as
    computing them everywhere). ``levels``: one DP degree with the end-of-step term's levels
    too (:func:`joint_root_terms`)."""
    best = beyond
    order = np.argsort(loose, kind="stable")
    for start in range(0, len(order), CHUNK):
        picked = order[start : start + CHUNK]
        if not loose[picked[0]] < best:
            break
        joint = joint_root_terms(shape, probes, caps, most, tail, picked, levels)
        best = min(best, float(np.maximum(loose[picked], joint).min()))
    return best


def joint_root_terms(
    shape: BatchShape,
    probes: np.ndarray,
    caps: np.ndarray,
    most: np.ndarray,
    tail: np.ndarray,
    picked: np.ndarray,
    levels: bool = False,
) -> np.ndarray:
    """The root bound of the probe intervals ``picked`` (indices into ``probes[:-1]``) with the
    fill and links joint at ``g_j+1`` (own DP: :func:`own_fill_links` of the blocks' ``most``;
    one DP degree: :func:`~megatron_h2.planner.uniform_root.uniform_fill_links` of the stages'
    ``caps``) and the end-of-step term at least ``tail`` (per interval): ``max(fill + z, own) +
    links >= max(joint + z, own + least links)`` (zero-bubble; the others add ``z`` outside the
    max). With ``levels`` (one DP degree) the least of these over the end-of-step term's levels
    ``[Z_i, Z_i+1]`` (:func:`~megatron_h2.planner.uniform_root.sync_levels`), each with the
    term at least ``Z_i`` and every stage holding at most what it can with its own at most
    ``Z_i+1``: on the 1,024-chip 8-type member the micro-batch-1 zero-bubble roots rise to
    1.379 s (DP 8, whose best plan is 1.49 s) and 1.229 s (DP 4) from 1.234 and 1.137 s."""
    at = picked + 1  # g_j+1
    low, tail = probes[picked], tail[picked]
    found = sync_levels(shape) if levels else None
    if found is None:
        if not shape.uniform:
            return _terms(shape, low, own_fill_links(shape, most[:, at]), tail)
        return _terms(shape, low, uniform_fill_links(shape, caps[:, at]), tail)
    # where the largest end-of-step term is in [Z_i, Z_i+1], every stage holds at most what it
    # can with its own term at most Z_i+1, and the term is at least Z_i
    if shape.uniform:
        joint = level_fill_links(shape, caps[:, at], found[1])  # level x interval
    else:
        capped = np.minimum(caps[:, None, at, :], found[1][:, :, None, None])
        flat = shape._most_layers(capped.reshape(len(caps), -1, caps.shape[2]))
        joint = own_fill_links(shape, flat).reshape(len(found[0]), len(picked))
    return _terms(shape, low, joint, np.maximum(tail, found[0][:, None])).min(axis=0)


def _terms(shape: BatchShape, low: np.ndarray, joint: np.ndarray, tail: np.ndarray) -> np.ndarray:
    """The root terms with the largest folded steady term at least ``low``, the fill plus links
    at least ``joint`` and the end-of-step term at least ``tail`` (broadcast together)."""
    own = shape._own_work(low)
    least_links = shape.root_links
    if shape.schedule == "zero-bubble":
        tail = np.maximum(tail, shape.tail_share * own)
        return shape.steady * low + np.maximum(joint + tail, own + least_links)
    return shape.steady * low + np.maximum(joint, own + least_links) + tail
