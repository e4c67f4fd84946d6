"""Orders of stages whose DP replicas split the micro-batches (per-stage data parallelism):
every replica's order runs to the end without a hang, and neighbouring replicas exchange their
common micro-batches in the same order on both sides."""

from __future__ import annotations

import itertools
import math

import pytest

from megatron_h2.pipeline_orders import (
    Action,
    replica_micro_batches,
    replica_warmup,
    schedule_order,
)


def replica_orders(schedule: str, dps: list[int], total: int,
                   rule: bool = True) -> dict[tuple[int, int], list[Action]]:
    p = len(dps)
    return {(s, r): schedule_order(schedule, s, p, 1, replica_micro_batches(total, d, r),
                                   replica_warmup(s, dps) if rule else None)
            for s, d in enumerate(dps) for r in range(d)}


def replay(orders: dict[tuple[int, int], list[Action]], dps: list[int]) -> bool:
    """Run every replica's actions in order, each as soon as its input exists (sends never
    wait); True if all finish. Micro-batch j's input on stage s comes from replica j mod DP."""
    p, done = len(dps), set()
    pointer = dict.fromkeys(orders, 0)
    progress = True
    while progress:
        progress = False
        for key, order in orders.items():
            s = key[0]
            while pointer[key] < len(order):
                a = order[pointer[key]]
                if a.kind == "F":
                    need = None if s == 0 else ("F", s - 1, a.micro_batch)
                elif a.kind == "W":
                    need = ("B", s, a.micro_batch)
                else:
                    need = ("F", s, a.micro_batch) if s == p - 1 else ("B", s + 1, a.micro_batch)
                if need is not None and need not in done:
                    break
                done.add((a.kind, s, a.micro_batch))
                pointer[key] += 1
                progress = True
    return all(pointer[key] == len(order) for key, order in orders.items())


def messages_in_order(orders: dict[tuple[int, int], list[Action]], dps: list[int]) -> None:
    """Between replica r of stage s and replica r' of stage s + 1 the sender's sends and the
    receiver's receives list the same micro-batches in the same order, both ways."""
    for s in range(len(dps) - 1):
        for r, q in itertools.product(range(dps[s]), range(dps[s + 1])):
            for kind, sender, receiver in (("F", (s, r), (s + 1, q)), ("B", (s + 1, q), (s, r))):
                common = {a.micro_batch for a in orders[receiver] if a.kind == kind}
                sent = [a.micro_batch for a in orders[sender]
                        if a.kind == kind and a.micro_batch in common]
                received = [a.micro_batch for a in orders[receiver]
                            if a.kind == kind and a.micro_batch in
                            {b.micro_batch for b in orders[sender]}]
                assert sent == received


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_replica_orders_never_hang(schedule: str) -> None:
    checked = 0
    for p in (2, 3, 4):
        for dps in itertools.product((1, 2, 3, 4), repeat=p):
            if p == 4 and len(set(dps)) < 3:
                continue  # keep the loop short: the varied ones
            step = math.lcm(*dps)
            for total in (step, 3 * step):
                orders = replica_orders(schedule, list(dps), total)
                assert replay(orders, list(dps)), (schedule, dps, total)
                messages_in_order(orders, list(dps))
                checked += 1
    assert checked > 200


def test_megatrons_warmup_per_replica_can_hang() -> None:
    dps = [1, 1, 2, 2, 1]
    assert not replay(replica_orders("1f1b", dps, 8, rule=False), dps)
    assert replay(replica_orders("1f1b", dps, 8), dps)


def test_replica_warmup_is_megatrons_under_uniform_dp() -> None:
    for p in (1, 2, 5):
        for d in (1, 2, 4):
            assert [replica_warmup(s, [d] * p) for s in range(p)] == list(range(p - 1, -1, -1))
    assert [replica_warmup(s, [1, 1, 2, 2, 1]) for s in range(5)] == [7, 6, 2, 1, 0]
    assert [replica_warmup(s, [1, 4, 1]) for s in range(3)] == [8, 1, 0]
    assert [replica_warmup(s, [4, 1]) for s in range(2)] == [1, 0]
    assert list(replica_micro_batches(8, 3, 1)) == [1, 4, 7]
