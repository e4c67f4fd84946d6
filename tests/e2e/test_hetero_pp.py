"""HeteroPP: stages on different chip types with their own TP and layer counts, joined by the
cross-vendor bridge; compared with one process (multi-rank runs, gloo, CPU).

The model is a GPT-3-style command line (Megatron's default architecture), so the word
embedding on the first chip type and its tied copy on the last are summed across the chip types
every step, also between stages of different TP degrees."""

import json

import pytest

from megatron_h2.training.main import main
from tests.helpers.dist_utils import losses
from tests.helpers.fork_run import fork_run
from tests.unit.pipeline.test_hetero_pp import MODEL, write_plan


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> dict[int, float]:
    out = tmp_path_factory.mktemp("ref") / "log.jsonl"
    assert main([*MODEL, "--data-path", corpus, "--micro-batch-size", "2",
                 "--global-batch-size", "8", "--log-jsonl", str(out)]) == 0
    return losses(out)


def close(got: dict[int, float], want: dict[int, float], rel: float) -> None:
    assert sorted(got) == sorted(want)
    for it, value in want.items():
        assert abs(got[it] - value) <= rel * abs(value), (it, got[it], value)


THREE_STAGES = [{"chip": "fast", "tensor_parallel_size": 2, "num_layers": 2},
                {"chip": "slow", "tensor_parallel_size": 1, "num_layers": 1,
                 "recompute": "full"},
                {"chip": "fast", "tensor_parallel_size": 2, "num_layers": 3,
                 "recompute": "selective"}]


@pytest.mark.e2e
def test_three_stages_tp_2_1_2_through_the_bridge(corpus, reference, tmp_path):
    plan = write_plan(tmp_path / "plan.yaml", THREE_STAGES)
    out, trace = tmp_path / "log.jsonl", tmp_path / "trace.json"
    proc = fork_run(5, [*MODEL, "--data-path", corpus, "--hetero-plan", plan, "--force-bridge",
                        "--log-jsonl", str(out), "--timeline-trace", str(trace)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    close(losses(out), reference, 1e-5)
    assert "bridge" in proc.stdout and "bubble" in proc.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    ranks = {e["tid"] for e in events if e.get("ph") == "X"}
    assert ranks == set(range(5))
    kinds = {e["cat"] for e in events if e.get("ph") == "X"}
    assert {"forward", "backward", "send_forward", "recv_forward"} <= kinds


@pytest.mark.e2e
def test_two_stages_tp_2_1_with_dp_2(corpus, reference, tmp_path):
    """Two chip types (emulated: every boundary through the bridge) with TP 2 and 1: each rank
    of the TP-1 stage sums the tied embedding with both TP-2 ranks of its replica."""
    plan = write_plan(tmp_path / "plan.yaml",
                      [{"chip": "fast", "tensor_parallel_size": 2, "num_layers": 4},
                       {"chip": "slow", "tensor_parallel_size": 1, "num_layers": 2}], dp=2)
    out = tmp_path / "log.jsonl"
    proc = fork_run(6, [*MODEL, "--data-path", corpus, "--hetero-plan", plan, "--force-bridge",
                        "--log-jsonl", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    close(losses(out), reference, 1e-5)


@pytest.mark.e2e
def test_bf16_bridge_and_emulated_slowdown(corpus, reference, tmp_path):
    chips = {"fast": {"device": "cpu"}, "slow": {"device": "cpu", "emulate_slowdown": 2.0}}
    plan = write_plan(tmp_path / "plan.yaml",
                      [{"chip": "fast", "tensor_parallel_size": 1, "num_layers": 4},
                       {"chip": "slow", "tensor_parallel_size": 1, "num_layers": 2}],
                      chips=chips)
    out = tmp_path / "log.jsonl"
    proc = fork_run(2, [*MODEL, "--data-path", corpus, "--hetero-plan", plan, "--force-bridge",
                        "--bridge-dtype", "bf16", "--log-jsonl", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    close(losses(out), reference, 1e-2)
    assert "emulating a chip 2x slower" in proc.stdout
