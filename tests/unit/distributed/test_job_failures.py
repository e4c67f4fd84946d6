"""A rank's own error vs the fallout of another rank's failure (JobFailures), in one process."""

from __future__ import annotations

import threading

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


def test_a_plain_runtime_error_is_fallout_only_after_another_rank_recorded_a_failure():
    failing, survivor = _ranks(2)
    plain = RuntimeError("Timed out waiting for recv")  # gloo's type for many things
    assert not survivor.is_fallout(plain)
    failing.record_own_failure()
    assert survivor.is_fallout(plain)
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


def test_gloo_words_for_a_lost_peer_are_fallout_at_once():
    """A killed rank records nothing: its neighbour printed a full gloo traceback."""
    _, survivor = _ranks(2)
    for words in ("[pair.cc:534] Connection closed by peer [127.0.0.1]:4411",
                  "Connection reset by peer", "Broken pipe"):
        assert survivor.is_fallout(RuntimeError(words))
    assert not survivor.is_fallout(ValueError("Connection closed by peer"))


def test_the_silent_rank_is_named_by_its_heartbeat():
    views = _ranks(3)
    for rank, view in enumerate(views):
        view.store.set(f"who/{rank}", f"rank {rank} (host h{rank}, stage {rank})")
        view.store.add(f"hb/{rank}", 1)
    beating = [True, True, False]  # rank 2 stopped

    def beat():
        for rank, view in enumerate(views):
            if beating[rank]:
                view.store.add(f"hb/{rank}", 1)

    stop = threading.Event()

    def loop():
        while not stop.wait(0.02):
            beat()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        assert views[0].silent_peers(0, 3, watch_s=0.3) == [2]
        assert views[0].describe(2) == "rank 2 (host h2, stage 2)"
        views[2].stop_heartbeat(2)  # a rank that ended normally is not silent
        assert views[1].silent_peers(1, 3, watch_s=0.3) == []
    finally:
        stop.set()
        thread.join()
    assert JobFailures().silent_peers(0, 2) == [] and JobFailures().describe(1) == "rank 1"


def test_the_heartbeat_reports_a_silent_peer_once(monkeypatch):
    import megatron_h2.distributed.failures as failures

    monkeypatch.setattr(failures, "BEAT_S", 0.05)
    watcher, silent = _ranks(2)
    silent.store.set("who/1", "rank 1 (host h1, stage 1)")
    said = []
    watcher.start_heartbeat(0, 2, "rank 0 (host h0, stage 0)", 0.3, said.append)
    watcher._beat.join(timeout=30)
    assert len(said) == 1 and said[0].startswith("rank 1 (host h1, stage 1) stopped responding: "
                                                 "no heartbeat for ")
    assert "(--heartbeat-timeout 0.3)" in said[0]
    assert silent.silent_peers(1, 2, watch_s=0.0) == [1]  # the watcher's finding, for all
