"""A rank's own error vs the fallout of another rank's failure (JobFailures), in one process."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_h2.distributed.failures import JobFailures


def _ranks(count: int) -> list[JobFailures]:
    """``count`` ranks' views of one job store."""
    store = dist.HashStore()
    views = []
    for _ in range(count):
        view = JobFailures()
        view.attach(dist.PrefixStore("megatron_h2", store))
        views.append(view)
    return views


def test_gloo_error_is_fallout_only_after_another_rank_recorded_a_failure():
    failing, survivor = _ranks(2)
    lost_peer = RuntimeError("Connection closed by peer")  # the type gloo raises for a lost peer
    assert not survivor.is_fallout(lost_peer)
    failing.record_own_failure()
    assert survivor.is_fallout(lost_peer)
    # errors of this rank's own making stay its own, whatever happened elsewhere
    assert not survivor.is_fallout(torch.OutOfMemoryError("out of memory"))
    assert not survivor.is_fallout(ValueError("bad shape"))


def test_dist_errors_are_fallout_even_without_a_store():
    alone = JobFailures()
    for exc in (dist.DistNetworkError("x"), dist.DistStoreError("x"), dist.DistBackendError("x")):
        assert alone.is_fallout(exc)
    assert not alone.is_fallout(RuntimeError("x"))
    alone.record_own_failure()  # no store: nothing to record, no error


def test_store_gone_with_its_host_counts_as_another_rank_failed(capfd):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False)
    survivor = JobFailures()
    survivor.attach(dist.PrefixStore("megatron_h2", client))
    assert not survivor.is_fallout(RuntimeError("x"))
    del server  # the rank hosting the store exits
    assert survivor.is_fallout(RuntimeError("Connection reset by peer"))
    survivor.record_own_failure()  # best effort: no exception
    assert capfd.readouterr().err == ""  # torch's native warning about the store is hidden
