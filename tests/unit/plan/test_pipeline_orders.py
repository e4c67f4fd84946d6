"""Pipeline schedule orders: Megatron's rules, torch's orders, and that every order runs
without a hang or a mismatched message under our point-to-point discipline."""

from __future__ import annotations

import itertools
import math

import pytest

from megatron_h2.errors import ConfigError
from megatron_h2.plan.orders import (
    Action,
    check_micro_batches,
    check_orders,
    check_replica_micro_batches,
    forward_order,
    interleaved,
    one_f_one_b,
    replica_micro_batches,
    replica_order,
    routed_leads,
    routed_orders,
    routed_warmups,
    schedule_order,
    zero_bubble,
)


def names(order: list[Action]) -> list[str]:
    return [str(a) for a in order]


def test_one_f_one_b_is_megatrons_order():
    assert names(one_f_one_b(0, 3, range(4))) == ["F0", "F1", "F2", "B0", "F3", "B1", "B2",
                                                  "B3"]
    assert names(one_f_one_b(2, 3, range(4))) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3",
                                                  "B3"]
    assert names(one_f_one_b(0, 4, range(2))) == ["F0", "F1", "B0", "B1"]  # m < p: all warm-up


def test_interleaved_is_megatrons_order():
    # p = 2, V = 2, m = 4: chunk 0 of micro-batches 0, 1, chunk 1 of 0, 1, chunk 0 of 2, 3 ...
    # stage 0 warms up (2 - 0 - 1) x 2 + (2 - 1) x 2 = 4 forwards
    assert names(interleaved(0, 2, 2, range(4))) == [
        "F0", "F1", "F0.1", "F1.1", "F2", "B0.1", "F3", "B1.1", "F2.1", "B0", "F3.1", "B1",
        "B2.1", "B3.1", "B2", "B3"]
    # m == p: the same warm-up rule (stage 1 of 2: (V - 1) x p = 2 forwards, then 1F1B)
    assert names(interleaved(1, 2, 2, range(2))) == ["F0", "F1", "F0.1", "B0.1", "F1.1",
                                                     "B1.1", "B0", "B1"]


def test_zero_bubble_defers_weight_gradients_by_the_stage_index():
    # ZB-H1, p = 3, stage 2 (last): no warm-up, W of micro-batch i two steps after its B
    assert names(zero_bubble(2, 3, 1, range(4))) == [
        "F0", "B0", "F1", "B1", "F2", "B2", "W0", "F3", "B3", "W1", "W2", "W3"]
    assert names(zero_bubble(0, 3, 1, range(4))) == [
        "F0", "F1", "F2", "B0", "W0", "F3", "B1", "W1", "B2", "W2", "B3", "W3"]


def test_zero_bubble_keeps_1f1b_peak_memory():
    """Activations live from F until W: at most p micro-batches on every stage (1F1B's stage 0)."""
    for p in (2, 4, 6):
        for s in range(p):
            live = peak = 0
            for a in zero_bubble(s, p, 1, range(3 * p)):
                live += {"F": 1, "B": 0, "W": -1}[a.kind]
                peak = max(peak, live)
            assert peak == p


@pytest.mark.parametrize("zb", [False, True])
def test_orders_equal_torch_pipelining(zb):
    """The interleaved 1F1B and zero-bubble orders are those of torch's
    ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    helper = getattr(schedules, "_get_1f1b_rank_ops", None)
    warmups = getattr(schedules, "_get_warmup_ops", None)
    if helper is None or warmups is None:
        pytest.skip("this torch has no pipelining order helpers")
    kinds = {"F": "F", "B": "B", "I": "B", "W": "W"}
    checked = 0
    for p in (2, 3, 4):
        for v in ((1, 2, 3) if zb else (2, 3)):
            for m in (p, 2 * p, 3 * p):
                for s in range(p):
                    warm = warmups(s, v, p, p, m, multiply_factor=1 if zb else 2)

                    def fwd(step, v=v, p=p, s=s):
                        return ((step // p) % v) * p + s

                    def bwd(step, v=v, p=p, s=s, warm=warm):
                        return (v - 1 - ((step - warm) // p) % v) * p + s

                    ops = helper(v, p, warm, v * m - warm, warm, s, fwd, bwd, s if zb else 0,
                                 enable_zero_bubble=zb)
                    theirs = [Action(kinds[a.computation_type.value], a.stage_index // p,
                                     a.microbatch_index) for a in ops if a is not None]
                    mine = (zero_bubble if zb else interleaved)(s, p, v, range(m))
                    assert mine == theirs, (p, v, m, s)
                    checked += 1
    assert checked > 20


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zero-bubble"])
def test_every_order_runs_without_hang_or_mismatch(schedule):
    checked = 0
    for p in (1, 2, 3, 4, 6):
        for v in (1, 2, 3):
            for m in range(1, 3 * p + 1):
                try:
                    check_micro_batches(schedule, p, v, m)
                except ConfigError:
                    continue
                micro_batches = [10 + 3 * j for j in range(m)]  # any ids, not 0..m-1
                check_orders([schedule_order(schedule, s, p, v, micro_batches)
                              for s in range(p)], v)
                check_orders([forward_order(s, p, v, micro_batches) for s in range(p)], v)
                checked += 1
    assert checked >= 20


def test_check_orders_catches_a_deadlock_and_a_mismatch():
    good = [one_f_one_b(s, 2, range(3)) for s in range(2)]
    check_orders(good, 1)
    hang = [list(good[0]), list(good[1])]
    hang[1][0], hang[1][1] = hang[1][1], hang[1][0]  # stage 1 runs B0 before F0
    with pytest.raises(AssertionError, match="deadlocks"):
        check_orders(hang, 1)
    swapped = [[Action("F", 0, 1), Action("F", 0, 0), Action("B", 0, 0), Action("B", 0, 1)],
               [Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)]]
    with pytest.raises(AssertionError, match="order"):
        check_orders(swapped, 1)
    with pytest.raises(AssertionError, match="twice"):
        check_orders([good[0] + [good[0][0]], good[1]], 1)


@pytest.mark.parametrize("schedule, p, v, m, fragment", [
    ("interleaved", 4, 2, 6, "multiple of the pipeline size 4"),
    ("zero-bubble", 2, 2, 3, "multiple of the pipeline size 2"),
    ("interleaved", 1, 2, 4, "need at least 2 pipeline stages"),
    ("1f1b", 2, 2, 4, "runs one model chunk per stage"),
    ("interleaved", 2, 1, 4, "needs virtual pipeline stages"),
    ("gpipe", 2, 1, 4, "must be one of"),
])
def test_micro_batch_rules(schedule, p, v, m, fragment):
    with pytest.raises(ConfigError, match=fragment):
        check_micro_batches(schedule, p, v, m)


def test_zero_bubble_without_virtual_stages_takes_any_micro_batch_count():
    check_micro_batches("zero-bubble", 4, 1, 3)
    check_micro_batches("1f1b", 4, 1, 5)


# ------------------------------------------------------------- per-stage data parallelism
def test_replica_micro_batches_are_j_mod_dp_in_groups_shared_by_neighbours():
    assert replica_micro_batches(8, [2, 1], 0, 1) == [1, 3, 5, 7]
    assert replica_micro_batches(8, [2, 1], 1, 0) == list(range(8))
    # interleaved: groups of p = 2 micro-batches of one residue class mod lcm(DP) = 2
    assert replica_micro_batches(8, [1, 2], 0, 0, chunks=2) == [0, 2, 1, 3, 4, 6, 5, 7]
    assert replica_micro_batches(8, [1, 2], 1, 1, chunks=2) == [1, 3, 5, 7]
    # the same DP everywhere: each replica's own micro-batches in ascending order
    for chunks in (1, 2):
        assert replica_micro_batches(12, [3, 3], 0, 2, chunks) == [2, 5, 8, 11]
        assert replica_micro_batches(6, [1, 1, 1], 2, 0, chunks) == list(range(6))
    with pytest.raises(ConfigError, match="no replica 2"):
        replica_micro_batches(8, [2, 1], 0, 2)


@pytest.mark.parametrize("schedule, chunks", [("1f1b", 1), ("zero-bubble", 1),
                                              ("interleaved", 2), ("zero-bubble", 2),
                                              ("interleaved", 3)])
def test_routed_orders_run_without_hang_or_mismatch(schedule, chunks):
    """Every replica's order over its own micro-batches, for many per-stage DP degrees: the
    replay of all replicas with routed messages finishes and every pair of replicas
    consumes its messages in the order they are sent (training and evaluation)."""
    checked = 0
    for p in (2, 3):
        for dps in itertools.product((1, 2, 3), repeat=p):
            lcm = math.lcm(*dps)
            for total in range(lcm, 2 * p * lcm + 1, lcm):
                try:
                    check_replica_micro_batches(schedule, dps, chunks, total)
                except ConfigError:
                    continue
                for forward in (False, True):
                    check_orders(routed_orders(schedule, dps, chunks, total, forward), chunks,
                                 dps)
                checked += 1
    assert checked >= 40


def test_routed_warmups_are_megatrons_with_one_dp_and_grow_where_needed():
    # the same DP everywhere: Megatron's p - s - 1 (1F1B), 2 (p - s - 1) + (V - 1) p
    assert routed_warmups("1f1b", (2, 2, 2), 1, 12) == (2, 1, 0)
    assert routed_warmups("interleaved", (2, 2), 2, 8) == (4, 2)
    # DP 1 / 3 / 1: stage 0 leads stage 1 by one micro-batch per replica of stage 1 (G_1 = 3,
    # G_0 = 6), which leads stage 2 by one (routed_leads)
    assert routed_leads((1, 3, 1)) == [6, 3, 0]
    assert routed_warmups("1f1b", (1, 3, 1), 1, 6) == (6, 1, 0)
    orders = [replica_order("1f1b", (1, 3, 1), 1, r, 1, 6) for r in range(3)]
    assert [str(a) for a in orders[0]] == ["F0", "F3", "B0", "B3"]
    # Megatron's own warm-ups on each replica's list would hang there
    naive = [one_f_one_b(s, 3, replica_micro_batches(6, (1, 3, 1), s, r))
             for s, dp in enumerate((1, 3, 1)) for r in range(dp)]
    with pytest.raises(AssertionError, match="deadlocks"):
        check_orders(naive, 1, (1, 3, 1))
    # interleaved with DP 1 / 2 / 1: warm-ups grown by the replay
    grown = routed_warmups("interleaved", (1, 2, 1), 2, 12)
    assert all(g >= b for g, b in zip(grown, (11, 5, 3))) and grown != (11, 5, 3)


def timed_step(dps: tuple[int, ...], total: int, schedule: str = "1f1b") -> float:
    """Step time of the routed orders when every replica of stage s takes DP_s time units per
    forward and 2 DP_s per backward (a balanced pipeline: each stage's chips together take 3
    units per micro-batch), each action starting once its input and its replica are free."""
    p = len(dps)
    orders = routed_orders(schedule, dps, 1, total)
    replicas = [(s, r) for s, dp in enumerate(dps) for r in range(dp)]
    ends: dict[tuple, float] = {}
    free = dict.fromkeys(replicas, 0.0)
    pointer = dict.fromkeys(replicas, 0)
    moved = True
    while moved:
        moved = False
        for (s, r), order in zip(replicas, orders):
            while pointer[s, r] < len(order):
                a = order[pointer[s, r]]
                if a.kind == "F":
                    need = None if s == 0 else ("F", s - 1, a.micro_batch)
                elif a.kind == "W":
                    need = ("B", s, a.micro_batch)
                else:
                    need = ("F", s, a.micro_batch) if s == p - 1 else ("B", s + 1, a.micro_batch)
                if need is not None and need not in ends:
                    break
                start = max(free[s, r], ends[need] if need else 0.0)
                took = {"F": 1, "B": 2, "W": 0}[a.kind] * dps[s]
                ends[a.kind, s, a.micro_batch] = free[s, r] = start + took
                pointer[s, r] += 1
                moved = True
    assert all(pointer[k] == len(o) for k, o in zip(replicas, orders))
    return max(free.values())


@pytest.mark.parametrize("dps", [(1, 4, 1), (1, 8, 1), (2, 4, 1), (1, 2, 1), (1, 4, 2, 1)])
def test_routed_orders_keep_a_wider_stage_busy(dps):
    """A balanced pipeline runs at its steady state (first micro-batch through every stage,
    then one micro-batch per 3 units on the DP-1 stages): the stage feeding a wider one sends
    its forwards early enough (with warm-ups of only ceil(later DP sum / DP_s) the wide
    stage would wait for them)."""
    total = 4 * math.lcm(*dps) * max(dps)
    fill = sum(3 * dp for dp in dps)
    steady = max((total // dp - 1) * 3 * dp for dp in dps)
    assert timed_step(dps, total) == steady + fill


def test_interleaved_routing_needs_shared_groups():
    """Ascending lists (groups not shared between replicas of neighbouring stages) put a
    boundary's chunks in another order than its receiver takes them."""
    dps, total = (1, 2), 8
    orders = []
    for s, dp in enumerate(dps):
        for r in range(dp):
            mbs = list(range(r, total, dp))
            orders.append(interleaved(s, 2, 2, mbs, routed_warmups("interleaved", dps, 2,
                                                                  total)[s]))
    with pytest.raises(AssertionError, match="order|deadlocks"):
        check_orders(orders, 2, dps)


@pytest.mark.parametrize("dps, schedule, chunks, total, fragment", [
    ((2, 1), "interleaved", 2, 6, "stage 0 (data_parallel_size 2): the interleaved schedule "
                                  "with virtual stages needs the number of micro-batches per "
                                  "replica (global batch / (micro-batch x DP) = 3)"),
    ((1, 3), "1f1b", 1, 4, "do not split over stage 1's 3 data-parallel replicas"),
    ((2, 2), "interleaved", 2, 6, "(global batch / (micro-batch x DP) = 3) to be a multiple"),
])
def test_replica_micro_batch_rules(dps, schedule, chunks, total, fragment):
    with pytest.raises(ConfigError) as err:
        check_replica_micro_batches(schedule, dps, chunks, total)
    assert fragment in str(err.value)
