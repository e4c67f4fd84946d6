"""Per-stage data parallelism: stages with different DP (and TP) degrees, micro-batch ``j`` on
replica ``j mod DP_s`` of every stage, activations routed between the replicas' TP groups.

Without processes: the routes, the topology, and bad per-stage plans as one line before any
process group. (The tied embedding's exact sum across processes, and torchrun launches against
one process: tests/e2e/test_stage_data_parallel.py, with MODEL, write_plan and dp_2_1 from
here.)"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch.distributed as dist
import yaml

from megatron_h2.distributed.boundary import (
    Transfer,
    linked_replicas,
    local_rows,
    rank_boundaries,
    rank_routes,
)
from megatron_h2.distributed.topology import Topology
from megatron_h2.errors import ConfigError
from megatron_h2.plan.schema import ChipSpec, HeteroPlan, StageSpec
from megatron_h2.training.main import main

SEQ = 8


def make_plan(tps: tuple[int, ...], dps: tuple[int, ...], total: int = 12,
              chunks: int = 1) -> HeteroPlan:
    stages = [StageSpec(chip="c", tensor_parallel_size=t, num_layers=chunks,
                        chunk_layers=(1,) * chunks if chunks > 1 else (),
                        data_parallel_size=d) for t, d in zip(tps, dps)]
    return HeteroPlan(data_parallel_size=1, micro_batch_size=1, global_batch_size=total,
                      chips={"c": ChipSpec(device="cpu")}, stages=stages)


# ------------------------------------------------------------------------------- routes
def test_linked_replicas_share_micro_batches():
    plan = make_plan((1, 2, 1), (2, 3, 1))
    assert linked_replicas(plan, 0, 1, 1) == [0, 1, 2]  # gcd 1: every replica
    assert linked_replicas(plan, 1, 2, 2) == [0]
    plan = make_plan((1, 1), (4, 2))
    assert linked_replicas(plan, 0, 3, 1) == [1] and linked_replicas(plan, 1, 1, 0) == [1, 3]
    for a, b in itertools.product(range(4), range(2)):
        shared = any(j % 4 == a and j % 2 == b for j in range(12))
        assert (b in linked_replicas(plan, 0, a, 1)) == shared


@pytest.mark.parametrize("tps, dps, sp", [
    ((1, 2), (2, 1), False), ((1, 2), (2, 1), True), ((2, 1, 4), (1, 3, 2), True),
    ((4, 2), (1, 2), False), ((2, 2), (3, 2), True),
])
def test_every_micro_batch_reaches_its_replica_once(tps, dps, sp):
    """Moving every micro-batch's activation (and gradient) through the rank routes delivers
    each receiving rank of replica ``j mod DP`` exactly its rows, from the sending replica
    ``j mod DP`` of the other stage, and the two ends' plans mirror each other."""
    plan = make_plan(tps, dps)
    routes = {r: rank_routes(plan, r, SEQ, sp) for r in range(plan.world_size)}

    def replica(stage: int, j: int) -> list[int]:  # the ranks that run micro-batch j there
        return [r for r in range(plan.world_size)
                if plan.rank_coordinates(r)[:2] == (stage, j % dps[stage])]

    for j, up, forward in itertools.product(range(12), range(len(tps) - 1), (True, False)):
        src, dst = (up, up + 1) if forward else (up + 1, up)
        for r in replica(dst, j):
            _, _, tp_rank = plan.rank_coordinates(r)
            mine = local_rows(SEQ, tps[dst], tp_rank, sp)
            route = routes[r][0 if forward else 1][j % dps[src]]
            filled = [0] * (mine.stop - mine.start)
            for tr in (route.fwd_recv if forward else route.bwd_recv):
                assert tr.peer in replica(src, j), (j, r, tr)
                peer = routes[tr.peer][1 if forward else 0][j % dps[dst]]
                assert Transfer(r, tr.remote, tr.local) in (peer.fwd_send if forward
                                                            else peer.bwd_send)
                for row in range(tr.local.start, tr.local.stop):
                    filled[row] += 1
            assert filled == [1] * len(filled), (j, r, forward, filled)


def test_rank_boundaries_needs_one_partner():
    assert rank_boundaries(make_plan((1, 2), (2, 2)), 0, SEQ, False)[1] is not None
    with pytest.raises(ConfigError, match="use rank_routes"):
        rank_boundaries(make_plan((1, 2), (2, 1)), 2, SEQ, False)


def test_interleaved_routes_wrap_around_to_every_linked_replica():
    plan = make_plan((1, 2), (2, 1), total=8, chunks=2)
    prev, nxt = rank_routes(plan, 2, SEQ, False)  # stage 1, TP rank 0: both boundaries
    assert sorted(prev) == sorted(nxt) == [0, 1]
    assert [t.peer for t in nxt[1].fwd_send] == [1]  # wrap-around: to stage 0 replica 1


def test_topology_describes_each_stages_dp():
    plan = make_plan((1, 2), (2, 1))
    topo = Topology(plan=plan, rank=1, world_size=4, stage=0, dp_rank=1, tp_rank=0)
    assert topo.dp_size == 2 and topo.peer_ranks(1, 0) == [2, 3]
    last = Topology(plan=plan, rank=3, world_size=4, stage=1, dp_rank=0, tp_rank=1)
    assert last.dp_size == 1


# ------------------------------------------------------------------------------- plans
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--seq-length", "32",
         "--max-position-embeddings", "32", "--lr", "3e-3", "--lr-warmup-iters", "2",
         "--seed", "11", "--train-iters", "10", "--log-interval", "1", "--eval-interval",
         "1000", "--eval-iters", "0", "--tokenizer-type", "NullTokenizer", "--vocab-size",
         "256", "--split", "90,10,0"]


def write_plan(path: Path, stages: list[dict], **extra) -> str:
    plan = {"data_parallel_size": 1, "micro_batch_size": 2, "global_batch_size": 8,
            "chips": {"fast": {"device": "cpu"}, "slow": {"device": "cpu"}}, "stages": stages,
            **extra}
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return str(path)


def dp_2_1(layers: object = 2) -> list[dict]:
    """Stage 0: DP 2 x TP 1 (ranks 0, 1); stage 1: DP 1 x TP 2 (ranks 2, 3)."""
    return [{"chip": "slow", "tensor_parallel_size": 1, "num_layers": layers,
             "data_parallel_size": 2},
            {"chip": "fast", "tensor_parallel_size": 2, "num_layers": layers}]


# ----------------------------------------------------------------------- bad plans
def _bad(case: str) -> tuple[list[dict], dict, int, str]:
    stages = dp_2_1()
    if case == "batch":  # 8 samples of 2 = 4 micro-batches, not divisible by DP 3
        stages[0]["data_parallel_size"] = 3
        return stages, {}, 5, "not divisible by micro_batch_size x stage 0's data_parallel_size 3"
    if case == "world":
        return stages, {}, 3, "needs world size 4"
    if case == "interleaved":  # 4 micro-batches: 2 per replica of stage 0, DP 4 gives 1
        stages = dp_2_1([1, 1])
        stages[0]["data_parallel_size"] = 4
        return stages, {}, 6, ("stage 0 (data_parallel_size 4): the interleaved schedule with "
                               "virtual stages needs the number of micro-batches per replica")
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["batch", "world", "interleaved"])
def test_bad_per_stage_plan_is_one_line_before_any_process_group(case, corpus, tmp_path,
                                                                 monkeypatch, capsys):
    stages, extra, world, fragment = _bad(case)
    plan = write_plan(tmp_path / "plan.yaml", stages, **extra)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    assert main([*MODEL, "--data-path", corpus, "--hetero-plan", plan]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and fragment in err, err
    assert not dist.is_initialized()
