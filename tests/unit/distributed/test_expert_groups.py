"""Expert parallelism's rank decomposition (Megatron-Core's order: expert TP fastest, then EP,
then expert DP) and the local experts of an EP rank."""

from __future__ import annotations

import pytest

from megatron_h2.distributed.topology import EPContext, expert_coordinates
from megatron_h2.plan.schema import StageSpec


def test_ep_spans_dp_replicas_when_etp_is_the_tp():
    stage = StageSpec("c", 2, 1, expert_model_parallel_size=2)  # TP 2 = ETP; with DP 4: 8 ranks
    coords = [expert_coordinates(stage, o) for o in range(8)]
    assert [c[0] for c in coords] == [0, 1] * 4  # the ETP rank is the TP rank
    assert [c[1] for c in coords] == [0, 0, 1, 1] * 2  # DP replicas 0 / 1 form an EP group
    assert [c[2] for c in coords] == [0] * 4 + [1] * 4  # expert DP: replicas 0 & 2, 1 & 3


def test_etp_1_puts_the_tp_ranks_into_one_ep_group():
    stage = StageSpec("c", 2, 1, expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    assert [expert_coordinates(stage, o) for o in range(4)] == [(0, 0, 0), (0, 1, 0),
                                                                 (0, 0, 1), (0, 1, 1)]


def test_local_experts_are_contiguous_global_indices():
    assert list(EPContext.single().local_experts(4)) == [0, 1, 2, 3]
    assert list(EPContext(group=object(), rank=1, size=2).local_experts(8)) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="invalid EP rank 2 of size 2"):
        EPContext(group=object(), rank=2, size=2)
    with pytest.raises(ValueError, match="EP group of size 2 needs"):
        EPContext(group=None, rank=0, size=2)
