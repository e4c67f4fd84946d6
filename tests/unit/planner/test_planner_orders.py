"""Pipeline schedule orders: Megatron's 1F1B and interleaved orders, ZB-H1, and what they hold."""

from __future__ import annotations

import pytest

from megatron_h2.errors import ConfigError
from megatron_h2.planner.held_activations import (
    check_schedule,
    held_states,
    held_totals,
    peak_in_flight,
    stage_order,
)

CASES = [  # (schedule, stages, micro-batches, chunks)
    *[("1f1b", p, m, 1) for p in (1, 2, 4) for m in (1, 3, 4, 9)],
    *[("zero-bubble", p, m, 1) for p in (2, 3, 5) for m in (1, 2, 4, 5, 11)],
    *[("interleaved", p, m, v) for p in (2, 3, 4) for v in (2, 3) for m in (p, 2 * p, 4 * p)],
]


def torch_order(schedule: str, p: int, m: int, v: int, rank: int) -> list[tuple[str, int, int]]:
    """The per-rank action order ``torch.distributed.pipelining`` computes (no process group)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = {
        "interleaved": schedules.ScheduleInterleaved1F1B,
        "zero-bubble": schedules.ScheduleInterleavedZeroBubble,
    }[schedule]
    obj = cls.__new__(cls)  # the order needs only these fields, not the stages
    obj.pp_group_size, obj.n_local_stages, obj._n_microbatches, obj.rank = p, v, m, rank
    obj.number_of_rounds = max(1, m // p)
    obj.microbatches_per_round = m // obj.number_of_rounds
    kinds = {"F": "F", "B": "B", "I": "B", "W": "W"}
    return [
        (kinds[action.computation_type.value], action.stage_index // p, action.microbatch_index)
        for action in obj._calculate_single_rank_operations(rank)
        if action is not None
    ]


@pytest.mark.parametrize("schedule,p,m,v", [c for c in CASES if c[0] != "1f1b"])
def test_orders_are_torch_pipelinings(schedule: str, p: int, m: int, v: int) -> None:
    for stage in range(p):
        assert stage_order(schedule, p, m, v, stage) == torch_order(schedule, p, m, v, stage)


def test_megatron_interleaved_example() -> None:
    # PP 2, V 2, 4 micro-batches: stage 0 warms up with 2 (p - 1) + (V - 1) p = 4 forwards
    # (chunk 0 of micro-batches 0, 1, then chunk 1 of 0, 1), backwards start on the last chunk
    assert stage_order("interleaved", 2, 4, 2, 0) == [
        ("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("F", 1, 1),
        ("F", 0, 2), ("B", 1, 0), ("F", 0, 3), ("B", 1, 1),
        ("F", 1, 2), ("B", 0, 0), ("F", 1, 3), ("B", 0, 1),
        ("B", 1, 2), ("B", 1, 3), ("B", 0, 2), ("B", 0, 3),
    ]  # fmt: skip
    assert stage_order("interleaved", 2, 4, 2, 1)[:4] == [
        ("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("B", 1, 0)
    ]  # fmt: skip


def test_zero_bubble_defers_weight_gradients_by_the_stage_index() -> None:
    # the last of 3 stages runs forward / input-backward twice before its first weight step
    assert stage_order("zero-bubble", 3, 4, 1, 2) == [
        ("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1), ("F", 0, 2), ("B", 0, 2),
        ("W", 0, 0), ("F", 0, 3), ("B", 0, 3), ("W", 0, 1), ("W", 0, 2), ("W", 0, 3),
    ]  # fmt: skip
    first = stage_order("zero-bubble", 3, 4, 1, 0)
    assert first[:4] == [("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("B", 0, 0)]
    assert first[4] == ("W", 0, 0)  # stage 0 runs each weight step right after its backward


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_every_action_once_in_dependency_order(schedule: str, p: int, m: int, v: int) -> None:
    kinds = ("F", "B", "W") if schedule == "zero-bubble" else ("F", "B")
    for stage in range(p):
        order = stage_order(schedule, p, m, v, stage)
        expected = {(k, c, i) for k in kinds for c in range(v) for i in range(m)}
        assert len(order) == len(expected) and set(order) == expected
        at = {action: n for n, action in enumerate(order)}
        for c in range(v):
            for i in range(m):
                assert at[("F", c, i)] < at[("B", c, i)]
                if schedule == "zero-bubble":
                    assert at[("B", c, i)] < at[("W", c, i)]


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_held_states_are_the_peaks_of_the_walk(schedule: str, p: int, m: int, v: int) -> None:
    split = schedule == "zero-bubble"
    for stage in range(p):
        states = held_states(schedule, p, m, v, stage)
        active, deferred, walk = [0] * v, [0] * v, []
        for kind, chunk, _ in stage_order(schedule, p, m, v, stage):
            active[chunk] += {"F": 1, "B": -1, "W": 0}[kind]
            deferred[chunk] += {"F": 0, "B": 1 if split else 0, "W": -1}[kind]
            walk.append((tuple(active), tuple(deferred)))
        flat = [a + d for a, d in walk]
        for state in walk:  # every state is covered by a returned one
            assert any(all(x >= y for x, y in zip(a + d, state[0] + state[1])) for a, d in states)
        assert all((a, d) in walk for a, d in states)  # and those are real states
        assert len(set(flat)) >= len(states)
        last, first = stage == p - 1, stage == 0
        reduced = {(sum(a), sum(d), a[-1] * last, d[-1] * last, d[0] * first) for a, d in states}
        peaks = [t for t in reduced if not any(o != t and all(x >= y for x, y in zip(o, t))
                                               for o in reduced)]  # fmt: skip
        assert sorted(held_totals(schedule, p, m, v, stage)) == sorted(peaks)


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (4, 4, 2), (3, 6, 3), (8, 16, 4), (2, 2, 2)])
def test_interleaved_keeps_megatrons_warm_up_in_flight(p: int, m: int, v: int) -> None:
    for stage in range(p):
        warmup = min(2 * (p - stage - 1) + (v - 1) * p, m * v)
        assert peak_in_flight("interleaved", p, m, v, stage) == min(warmup + 1, m * v)


def test_zero_bubble_holds_at_most_p_micro_batches_like_1f1b_stage_0() -> None:
    p, m = 4, 8
    for stage in range(p):
        (state,) = [t for t in held_totals("zero-bubble", p, m, 1, stage) if t[0] == p - stage]
        assert state[:2] == (p - stage, stage)  # 1F1B's activations plus `stage` deferred
    assert held_totals("1f1b", p, m, 1, 0) == ((p, 0, 0, 0, 0),)


@pytest.mark.parametrize(
    "schedule,p,m,v,message",
    [
        ("interleaved", 4, 6, 2, "multiple of the pipeline size 4"),
        ("interleaved", 1, 4, 2, "need at least 2 pipeline stages"),
        ("interleaved", 2, 4, 1, "needs virtual pipeline stages"),
        ("1f1b", 2, 4, 2, "one model chunk"),
        ("zero-bubble", 2, 4, 2, "one model chunk"),
    ],
)
def test_schedule_rules(schedule: str, p: int, m: int, v: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_schedule(schedule, p, m, v)
