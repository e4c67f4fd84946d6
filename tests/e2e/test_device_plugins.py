"""Vendor plug-ins in a job: a two-stage torchrun job whose stage 0 runs on the plug-in "cpu2"
and stage 1 on the CPU, through the bridge, with the losses of one process."""

from __future__ import annotations

import pytest

from megatron_h2.devices import PLUGINS_ENV
from tests.helpers.cpu2_plugin import CPU2_PLUGIN
from tests.helpers.dist_utils import losses, torchrun
from tests.unit.devices.test_plugins import CHIPS, MODEL, _plan


@pytest.mark.e2e
def test_stage_on_cpu2_and_stage_on_cpu_train_as_one_process(corpus, tiny_reference, tmp_path):
    log = tmp_path / "log.jsonl"
    plan = _plan(tmp_path / "plan.yaml", CHIPS)
    proc = torchrun(2, [*MODEL, "--data-path", corpus, "--hetero-plan", plan, "--log-jsonl",
                        str(log), "--precision-check-interval", "5"],
                    env_extra={PLUGINS_ENV: CPU2_PLUGIN})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = losses(log), tiny_reference
    assert sorted(got) == list(range(1, 11)) == sorted(want)
    for it, value in want.items():
        assert abs(got[it] - value) <= 1e-5 * abs(value), (it, got[it], value)
    out = proc.stdout
    assert "stage 0: chip vendor2 (cpu2)" in out and "stage 1: chip host (cpu)" in out
    assert "bridge" in out  # the boundary between the vendors crossed the bridge
    assert "stage 0 (chip vendor2, cpu2): 0 of " in out and "stage 1 (chip host, cpu): 0 of " in out
    assert out.count("precision check at iteration") == 2
