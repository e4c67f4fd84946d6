"""tests/helpers/dist_utils.run_distributed, which most multi-process tests here use: its ranks
are forked from a server that imported torch once, yet each rank sees the caller's environment
as it is at the call, as a freshly spawned interpreter would."""

import os

import pytest

from tests.helpers.dist_utils import run_distributed

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
