"""CPU emulation of a slower chip pads a pass by its own work (CPU time), not by the time other
processes held the core; the straggler report compares ranks doing the same work."""

from __future__ import annotations

import time

import pytest

from megatron_h2.devices import get_accelerator
from megatron_h2.monitoring.stage_clock import StageClock, emulation_pad_s, straggler_report


def test_pad_is_slowdown_minus_one_times_the_work() -> None:
    assert emulation_pad_s(1.0, 0.5, 0.1) == 0.0
    assert emulation_pad_s(3.0, 0.5, 0.1) == pytest.approx(0.2)  # CPU time, not wall time
    assert emulation_pad_s(3.0, 0.5, None) == pytest.approx(1.0)  # no CPU time: the wall time
    assert emulation_pad_s(3.0, 0.1, 0.2) == pytest.approx(0.2)  # never more than the wall


def test_waiting_inside_a_pass_is_not_multiplied() -> None:
    """A pass that waits 50 ms off the CPU (as when another process holds the core) computes
    almost nothing, so a 6x chip pads it by almost nothing; one that computes 50 ms pads 250."""
    clock = StageClock(get_accelerator("cpu"), slowdown=6.0)
    with clock.compute("forward", 0):
        time.sleep(0.05)
    assert clock.padded_s < 0.02
    clock.take_kinds()
    with clock.compute("backward", 0):
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
    assert clock.padded_s > 0.2
    assert clock.take_kinds()["backward"] > 0.25


def test_straggler_report_compares_ranks_doing_the_same_work():
    chips = ["fast"] * 5 + ["slow"] * 2
    stages = [0, 0, 0, 1, 1, 2, 2]
    text = straggler_report(chips, stages, [1.0, 1.0, 1.6, 3.0, 3.1, 2.0, 2.0])
    # stage 1 does more work than stage 0 on the same chip type: that is no straggler
    assert text == ("stragglers (> 20% over their stage's median): fast: rank 2 +60%; "
                    "slow: none")
    assert straggler_report(chips, stages, [1.0] * 7).endswith("fast: none; slow: none")
