"""A rank that stops responding is named by the heartbeat long before the collective timeout
(a SIGSTOPped rank used to be found only by the 10-minute timeout, with tracebacks)."""

from __future__ import annotations

import pytest

from tests.helpers.dist_utils import torchrun
from tests.unit.training.test_parallel_training import MODEL


@pytest.mark.e2e
def test_a_stopped_rank_is_named_in_one_line(corpus):
    proc = torchrun(2, [*MODEL, "--data-path", corpus, "--pipeline-model-parallel-size", "2",
                        "--train-iters", "50", "--heartbeat-timeout", "5",
                        "--distributed-timeout-minutes", "10"],
                    # torchrun then SIGTERMs the stopped rank, which cannot act on it, and
                    # SIGKILLs it after its shutdown timeout (30 s by default): 2 s here
                    env_extra={"MEGATRON_H2_INJECT_FAULT": "1:3:stop",
                               "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "2"}, timeout=300)
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith(("error:", "[rank"))]
    assert len(ours) == 1, proc.stderr[-3000:]
    assert ours[0].startswith("error: [rank 0] rank 1 (host ")
    assert ", stage 1, chip default) stopped responding: no heartbeat for " in ours[0]
    assert "(--heartbeat-timeout 5); stopping the job" in ours[0]
    assert "frame #" not in proc.stderr and "gloo" not in proc.stderr
