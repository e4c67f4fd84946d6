"""tests/helpers/dist_utils.run_distributed, which most multi-process tests here use: its ranks
are forked from a server that imported torch once, yet each rank sees the caller's environment
as it is at the call, as a freshly spawned interpreter would."""

import os

import pytest

from tests.helpers.dist_utils import run_distributed, tiny_model_flags
from tests.helpers.fork_run import fork_run

pytestmark = pytest.mark.e2e  # starts processes

MARK = "MEGATRON_H2_TEST_RUN_DISTRIBUTED_MARK"


def _environ_worker(rank: int, world_size: int) -> tuple[str | None, int]:
    import torch.distributed as dist

    return os.environ.get(MARK), dist.get_world_size()


def test_ranks_see_the_callers_environment_at_the_call(monkeypatch):
    monkeypatch.delenv(MARK, raising=False)
    assert run_distributed(_environ_worker, 2) == [(None, 2), (None, 2)]  # the server is up
    monkeypatch.setenv(MARK, "set after the server started")
    assert run_distributed(_environ_worker, 2) == [("set after the server started", 2)] * 2


def test_fork_run_reports_what_torchrun_would(corpus):
    """tests/helpers/fork_run: a job whose ranks stop at a bad flag returns their error code and
    their stderr (rank 0 speaks for all, as under torchrun); a good job's ranks join one group
    through the store this process hosts and print to its stdout."""
    bad = fork_run(2, ["--num-layers", "x"])
    assert bad.returncode == 2 and bad.stderr.startswith("error: "), bad.stderr
    good = fork_run(2, [*tiny_model_flags(num_layers=2, train_iters=3), "--data-path", corpus,
                         "--micro-batch-size", "2", "--global-batch-size", "4"])
    assert good.returncode == 0, good.stderr[-3000:]
    assert "parallel: world 2 | DP 2" in good.stdout, good.stdout
    assert good.stdout.count("iteration        3/       3") == 1  # the one logging rank
