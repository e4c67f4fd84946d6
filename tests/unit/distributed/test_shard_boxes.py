"""Which elements of a full tensor a holding covers, and what two layouts share: checked against
the elements themselves (a full tensor of indices, sharded by the runtime's own shard_tensor)."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_h2.distributed.shard_boxes import Holding, ParamLayout, boxes, flat_rects, transfers
from megatron_h2.parallel.sharding import TPShard, shard_tensor

LAYOUTS = [  # (full shape, shard dim, blocks)
    ((12, 6), 0, 1), ((12, 6), 0, 2), ((6, 12), 1, 1), ((12,), 0, 1), ((12,), 0, 2),
    ((5, 3), None, 1), ((7,), None, 1),
]


def held_indices(holding: Holding) -> torch.Tensor:
    """The full-tensor flat indices of the holding's elements, in its own order."""
    layout = holding.layout
    full = torch.arange(torch.Size(layout.full_shape).numel()).view(layout.full_shape)
    if layout.shard_dim is not None:
        full = shard_tensor(full, TPShard(layout.shard_dim, layout.blocks), holding.tp_rank,
                            holding.tp_size)
    return full.reshape(-1)[holding.start:holding.stop]


def random_holding(rng: random.Random, layout: ParamLayout, tp_size: int) -> Holding:
    numel = torch.Size(layout.full_shape).numel() // (1 if layout.shard_dim is None else tp_size)
    start = rng.randrange(numel)
    return Holding(layout, rng.randrange(tp_size), tp_size, start, rng.randint(start + 1, numel))


def test_flat_rects_cover_a_range_in_order():
    for start, stop in ((0, 12), (1, 11), (2, 5), (6, 12), (5, 6), (0, 1)):
        covered = [r * 4 + c for r0, r1, c0, c1 in flat_rects(start, stop, 4)
                   for r in range(r0, r1) for c in range(c0, c1)]
        assert covered == list(range(start, stop))


@pytest.mark.parametrize("shape, dim, blocks", LAYOUTS)
def test_boxes_are_the_holdings_elements(shape, dim, blocks):
    rng = random.Random(0)
    layout = ParamLayout("p", shape, dim, blocks)
    cols = shape[-1] if len(shape) == 2 else shape[0]
    for tp_size in (1, 2, 3):
        if dim is not None and shape[dim] % (blocks * tp_size):
            continue
        for _ in range(30):
            holding = random_holding(rng, layout, tp_size)
            mine = held_indices(holding)
            local_cols = holding.local_shape[1]
            seen = []
            for box in boxes(holding):
                for r in range(box.row0, box.row1):
                    for c in range(box.col0, box.col1):
                        index = ((box.local_row + r - box.row0) * local_cols
                                 + box.local_col + c - box.col0 - holding.start)
                        flat = (r * cols + c) if len(shape) == 2 else c
                        assert int(mine[index]) == flat
                        seen.append(index)
            assert sorted(seen) == list(range(holding.numel))


@pytest.mark.parametrize("shape, dim, blocks", LAYOUTS)
def test_transfers_move_every_shared_element_once(shape, dim, blocks):
    """Between two layouts of one parameter (other TP degrees, other ranges), the transfers
    cover exactly the elements both hold, each at the right place on both sides."""
    rng = random.Random(1)
    layout = ParamLayout("p", shape, dim, blocks)
    sizes = [t for t in (1, 2, 3) if dim is None or shape[dim] % (blocks * t) == 0]
    for _ in range(40):
        a = random_holding(rng, layout, rng.choice(sizes))
        b = random_holding(rng, layout, rng.choice(sizes))
        ia, ib = held_indices(a), held_indices(b)
        moved = []
        for part in transfers([a], [b]):
            assert (part.send_index, part.recv_index) == (0, 0)
            for dr in range(part.rows):
                for dc in range(part.cols):
                    sa = (part.send_row + dr) * a.local_shape[1] + part.send_col + dc - a.start
                    sb = (part.recv_row + dr) * b.local_shape[1] + part.recv_col + dc - b.start
                    assert int(ia[sa]) == int(ib[sb])
                    moved.append(int(ia[sa]))
        assert sorted(moved) == sorted(set(ia.tolist()) & set(ib.tolist()))


def test_only_primary_holdings_send_and_shapes_must_agree():
    layout = ParamLayout("p", (4, 4), 0)
    copy = ParamLayout("p", (4, 4), 0, primary=False)
    whole = Holding(layout, 0, 1, 0, 16)
    assert transfers([Holding(copy, 0, 1, 0, 16)], [whole]) == []
    assert sum(t.numel for t in transfers([whole], [Holding(copy, 1, 2, 0, 8)])) == 8
    assert transfers([whole], [Holding(ParamLayout("q", (4, 4), 0), 0, 1, 0, 16)]) == []
    with pytest.raises(ValueError, match="shape"):
        transfers([whole], [Holding(ParamLayout("p", (8, 2), 0), 0, 1, 0, 16)])
    with pytest.raises(ValueError, match="vectors and matrices"):
        ParamLayout("p", (2, 2, 2), 0)
