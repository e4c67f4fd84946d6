"""Megatron's batch ramp-up under pipeline and data parallelism (forked ranks, PP 2 x DP 2) with the
losses of one process."""

import json

import pytest

from megatron_h2.training.main import main
from tests.helpers.dist_utils import losses
from tests.helpers.fork_run import fork_run
from tests.helpers.tiny_runs import MODEL


@pytest.mark.e2e
def test_rampup_under_pipeline_and_data_parallel_matches_one_process(corpus, tmp_path):
    """PP 2 x DP 2: micro-batches per replica grow 1, 2, 3, 4 with the batch (fewer than the
    pipeline's stages at first); the loss counts tokens over the whole batch, across replicas
    (--eod-mask-loss --calculate-per-token-loss)."""
    flags = [*MODEL, "--data-path", corpus, "--global-batch-size", "16", "--train-samples",
             "120", "--rampup-batch-size", "4", "4", "30", "--eod-mask-loss",
             "--calculate-per-token-loss"]
    assert main([*flags, "--log-jsonl", str(tmp_path / "one.jsonl")]) == 0
    proc = fork_run(4, [*flags, "--pipeline-model-parallel-size", "2", "--log-jsonl",
                        str(tmp_path / "pp_dp.jsonl")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    want, got = losses(tmp_path / "one.jsonl"), losses(tmp_path / "pp_dp.jsonl")
    assert sorted(got) == sorted(want)
    assert all(abs(got[i] - want[i]) <= 1e-5 * abs(want[i]) for i in want)
    sizes = [json.loads(x)["global_batch_size"] for x in
             (tmp_path / "pp_dp.jsonl").read_text().splitlines()]
    assert sizes[:6] == [4, 4, 4, 8, 12, 16] and len(sizes) == 10
