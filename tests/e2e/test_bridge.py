"""DiComm pipeline bridge in a gloo world: transfers between stages of different TP degree (direct
and through the bridge, host-staged, chunked, bf16 on the wire) and PipeComm under the 1F1B
schedule against one process.

One gloo world of six ranks is spawned per module fixture and runs many small layouts (ranks
outside a layout only join the barrier); each test then reads its scenario's result. (The
transfer plans themselves, without processes: tests/unit/distributed/test_bridge.py.)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from megatron_h2.distributed.boundary import rank_boundaries
from megatron_h2.distributed.bridge import Bridge, BridgeConfig
from megatron_h2.distributed.p2p import PipeComm
from megatron_h2.distributed.topology import Topology
from megatron_h2.pipeline.schedule_runner import forward_backward_1f1b
from megatron_h2.plan.schema import HeteroPlan
from tests.helpers.dist_utils import run_distributed
from tests.unit.distributed.test_bridge import (
    HIDDEN,
    MBS,
    SEQ,
    global_tensor,
    make_plan,
    make_topo,
    rows_of,
)

WORLD = 6


@dataclass(frozen=True)
class Case:
    """One layout run inside the shared six-rank world."""

    name: str
    tps: tuple[int, ...]
    dp: int
    sp: bool
    force: bool = False  # route every boundary through the bridge
    dtype: torch.dtype | None = None  # bridge wire dtype
    chunk_mb: float = 4.0
    devices: tuple[str, ...] | None = None  # plan devices (every rank still runs on the CPU)
    combined: bool = False  # exchange through send_forward_recv_backward & co
    default_group: bool = False  # bridge over the default (gloo) group instead of a new one
    micro: int = 3
    staged: bool = False  # bridge through host buffers and the stager thread, as on a GPU

    @property
    def bridged(self) -> bool:
        return self.force or len(set(self.devices or ("cpu",))) > 1


def _transfer_cases() -> list[Case]:
    cases = []
    pairs = [((2, 1), 1), ((2, 1), 2), ((1, 2), 1), ((1, 2), 2), ((2, 4), 1), ((4, 2), 1),
             ((2, 2), 1)]
    for (tps, dp), sp, force in itertools.product(pairs, (False, True), (False, True)):
        path = "bridge" if force else "direct"
        cases.append(Case(f"{tps[0]}to{tps[1]}-dp{dp}-sp{int(sp)}-{path}", tps, dp, sp, force))
    for tps, sp in itertools.product(((2, 4), (4, 2)), (False, True)):
        cases.append(Case(f"{tps[0]}to{tps[1]}-sp{int(sp)}-bf16", tps, 1, sp, True,
                          torch.bfloat16))
    for tps, dp, sp in (((2, 1), 2, True), ((4, 2), 1, False), ((1, 4), 1, True)):
        cases.append(Case(f"{tps[0]}to{tps[1]}-dp{dp}-sp{int(sp)}-tinychunks", tps, dp, sp, True,
                          chunk_mb=1e-4))
    for tps, sp in (((2, 1), True), ((1, 2), False)):
        cases.append(Case(f"{tps[0]}to{tps[1]}-dp2-sp{int(sp)}-staged-tinychunks", tps, 2, sp,
                          True, chunk_mb=1e-4, staged=True, combined=sp, micro=4))
    cases.append(Case("1to4-bf16-tinychunks-defaultgroup", (1, 4), 1, True, True,
                      torch.bfloat16, 1e-4, default_group=True))
    for sp in (False, True):
        cases.append(Case(f"2to1to2-sp{int(sp)}-mixed-devices", (2, 1, 2), 1, sp,
                          devices=("cpu", "cpu", "npu")))
    for tps, dp, force in (((2, 1), 2, True), ((1, 2), 2, False), ((4, 2), 1, True),
                           ((2, 4), 1, False)):
        for sp in (False, True):
            path = "bridge" if force else "direct"
            cases.append(Case(f"{tps[0]}to{tps[1]}-dp{dp}-sp{int(sp)}-{path}-combined", tps, dp,
                              sp, force, combined=True, micro=4))
    return cases


def _pipeline_cases() -> list[Case]:
    return [
        Case("2-1-2-direct", (2, 1, 2), 1, False, micro=5),
        Case("2-1-2-sp-bridge", (2, 1, 2), 1, True, True, micro=5),
        Case("2-1-2-sp-direct-one-microbatch", (2, 1, 2), 1, True, micro=1),
        Case("2-1-2-sp-mixed-devices", (2, 1, 2), 1, True, devices=("cpu", "cpu", "npu"),
             micro=4),
        Case("1-2-dp2-sp-direct", (1, 2), 2, True, micro=4),
        Case("1-2-dp2-bridge-tinychunks", (1, 2), 2, False, True, chunk_mb=1e-3, micro=4),
        Case("2-4-sp-bridge", (2, 4), 1, True, True, micro=3),
        Case("4-2-direct", (4, 2), 1, False, micro=3),
        Case("2-1-dp2-sp-bridge-bf16", (2, 1), 2, True, True, torch.bfloat16, micro=4),
        Case("2-1-2-staged-bf16-chunks", (2, 1, 2), 1, False, True, torch.bfloat16, 1e-3,
             micro=5, staged=True),
    ]


TRANSFER_CASES = _transfer_cases()
PIPELINE_CASES = _pipeline_cases()


class Recorder:
    """A CommObserver that keeps every interval."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, float, float]] = []

    def on_comm(self, kind: str, micro_batch: int, start_s: float, end_s: float,
                chunk: int = 0) -> None:
        self.events.append((kind, micro_batch, start_s, end_s))


def case_plan(case: Case) -> HeteroPlan:
    return make_plan(case.tps, case.dp, case.micro, case.devices)


def case_comm(case: Case, topo: Topology, cpu_group, observer=None) -> PipeComm:
    config = BridgeConfig(force=case.force, dtype=case.dtype, chunk_mb=case.chunk_mb)
    comm = PipeComm(topo, MBS, SEQ, HIDDEN, case.sp, torch.float32, torch.device("cpu"), config,
                    None if case.default_group else cpu_group, observer=observer)
    for side in (comm.prev, comm.next):
        if case.staged and side is not None and isinstance(side.link, Bridge):
            side.link.staged = True
    return comm


def _wire(case: Case, t: torch.Tensor) -> torch.Tensor:
    """What a tensor becomes after crossing (a bridge with a wire dtype rounds it)."""
    bridged = case.bridged
    return t.to(case.dtype).to(t.dtype) if (case.dtype is not None and bridged) else t


def run_transfer_case(case: Case, rank: int, cpu_group) -> dict:
    plan = case_plan(case)
    topo = make_topo(plan, rank)
    rec = Recorder()
    comm = case_comm(case, topo, cpu_group, rec)
    s, d, rows = topo.stage, topo.dp_rank, rows_of(plan, rank, case.sp)
    first, last = topo.is_first_stage, topo.is_last_stage
    act = [global_tensor(1, s, d, k, 1)[:, rows] for k in range(case.micro)]  # my outputs
    grad = [global_tensor(1, s - 1, d, k, 0)[:, rows] for k in range(case.micro)]  # my inputs'
    want_in = [_wire(case, global_tensor(1, s - 1, d, k, 1)[:, rows]) for k in range(case.micro)]
    want_grad = [_wire(case, global_tensor(1, s, d, k, 0)[:, rows]) for k in range(case.micro)]
    errors: list[str] = []

    def check(what: str, got: torch.Tensor | None, want: torch.Tensor) -> None:
        if got is None or got.shape != want.shape or not torch.equal(got, want):
            errors.append(f"rank {rank} {what}: got {None if got is None else got.shape}, "
                          f"want {want.shape}")

    if case.combined:  # two stages: the steady-state calls of 1F1B
        if first:
            comm.send_forward(act[0])
            for k in range(1, case.micro):
                check(f"grad {k - 1}", comm.send_forward_recv_backward(act[k]), want_grad[k - 1])
            check("last grad", comm.recv_backward(), want_grad[-1])
        else:
            check("act 0", comm.recv_forward(), want_in[0])
            for k in range(1, case.micro):
                x = comm.send_backward_recv_forward(grad[k - 1])
                check(f"act {k}", x, want_in[k])
                if x is None or not x.requires_grad:
                    errors.append(f"rank {rank}: received activation {k} needs no grad")
            comm.send_backward(grad[-1])
    else:
        for k in range(case.micro if not last else 0):
            comm.send_forward(act[k])
        for k in range(case.micro if not first else 0):
            check(f"act {k}", comm.recv_forward(), want_in[k])
        for k in range(case.micro if not first else 0):
            comm.send_backward(grad[k])
        for k in range(case.micro if not last else 0):
            check(f"grad {k}", comm.recv_backward(), want_grad[k])
    comm.wait_sends()
    comm.wait_sends()  # nothing pending: a no-op
    stats = comm.stats()
    comm.close()
    return {"errors": errors, "stats": stats, "paths": comm.paths, "events": rec.events}


def stage_weight(stage: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + stage)
    return torch.randn(HIDDEN, HIDDEN, generator=gen) * 0.3


def stage_forward(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The toy stage: a fixed linear map and tanh, row-wise (so SP rows are independent)."""
    return torch.tanh(x @ weight)  # [b, rows, h]


def run_pipeline_case(case: Case, rank: int, cpu_group) -> dict:
    """1F1B over the toy stages; returns this rank's weight gradient."""
    plan = case_plan(case)
    topo = make_topo(plan, rank)
    comm = case_comm(case, topo, cpu_group)
    rows = rows_of(plan, rank, case.sp)
    weight = torch.nn.Parameter(stage_weight(topo.stage))
    loss_weights = global_tensor(3)[:, rows]

    def step(i: int, inp: torch.Tensor | None) -> torch.Tensor:
        x = global_tensor(2, topo.dp_rank, i)[:, rows] if topo.is_first_stage else inp
        y = stage_forward(x, weight)
        return (y * loss_weights).sum() if topo.is_last_stage else y

    forward_backward_1f1b(step, case.micro, comm, topo.stage, topo.pp_size)
    comm.wait_sends()
    comm.close()
    return {"stage": topo.stage, "dp": topo.dp_rank, "grad": weight.grad.numpy().copy()}


def reference_grads(case: Case, dp_rank: int) -> list[torch.Tensor]:
    """Weight gradients of one replica computed in one process over the full sequence."""
    weights = [torch.nn.Parameter(stage_weight(s)) for s in range(len(case.tps))]
    for i in range(case.micro):
        y = global_tensor(2, dp_rank, i)
        for w in weights:
            y = stage_forward(y, w)
            if case.dtype is not None and w is not weights[-1]:
                y = y.to(case.dtype).to(torch.float32)  # what the bf16 wire does to it
        (y * global_tensor(3)).sum().backward()
    return [w.grad for w in weights]


def world_worker(rank: int, world_size: int, transfers: list[Case],
                 pipelines: list[Case]) -> dict:
    cpu_group = dist.new_group(backend="gloo")
    out: dict = {}
    for kind, cases, run in (("transfer", transfers, run_transfer_case),
                             ("pipeline", pipelines, run_pipeline_case)):
        for case in cases:
            if rank < case_plan(case).world_size:
                out[(kind, case.name)] = run(case, rank, cpu_group)
            dist.barrier()
    return out


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_distributed(world_worker, WORLD, TRANSFER_CASES, PIPELINE_CASES, timeout=240)


def expected_bytes(case: Case, rank: int) -> int:
    """Wire bytes ``rank`` sends in a transfer case, from its plan."""
    prev, nxt = rank_boundaries(case_plan(case), rank, SEQ, case.sp)
    pieces = (prev.bwd_send if prev else ()) + (nxt.fwd_send if nxt else ())
    size = 2 if case.dtype is not None else 4
    return case.micro * sum(MBS * t.num_rows * HIDDEN * size for t in pieces)


@pytest.mark.e2e
@pytest.mark.parametrize("case", TRANSFER_CASES, ids=lambda c: c.name)
def test_transfer(world: list[dict], case: Case) -> None:
    """Every receiver gets exactly its slice (forward), every sender its gradient (backward)."""
    plan = case_plan(case)
    for rank in range(plan.world_size):
        res = world[rank][("transfer", case.name)]
        assert res["errors"] == []
        stage = plan.rank_coordinates(rank)[0]
        path = "bridge" if case.bridged else "direct"
        if case.devices:  # only the boundary into the 'npu' stage is bridged
            want = {"prev": [None, "direct", "bridge"][stage],
                    "next": ["direct", "bridge", None][stage]}
        else:
            want = {"prev": None if stage == 0 else path, "next": path if stage == 0 else None}
        assert res["paths"] == want
        stats = res["stats"]
        sent = stats["bridge_bytes"] + stats["direct_bytes"]
        assert sent == expected_bytes(case, rank)
        if not case.devices:
            assert stats[f"{'direct' if path == 'bridge' else 'bridge'}_bytes"] == 0
        if case.chunk_mb < 1e-3 and sent:
            assert stats["bridge_chunks"] > stats["bridge_transfers"]
        elif sent:
            assert stats["bridge_chunks"] + stats["direct_chunks"] == (
                stats["bridge_transfers"] + stats["direct_transfers"])
        kinds: dict[str, list[int]] = {}
        for kind, mb, start, end in res["events"]:
            assert end >= start
            if kind == "wait":  # wait_sends blocked on sends in flight
                assert mb == -1
            else:
                kinds.setdefault(kind, []).append(mb)
        expect = {}
        if stage > 0:
            expect |= {"recv_forward": case.micro, "send_backward": case.micro}
        if stage < len(case.tps) - 1:
            expect |= {"send_forward": case.micro, "recv_backward": case.micro}
        assert {k: sorted(v) for k, v in kinds.items()} == {
            k: list(range(n)) for k, n in expect.items()}


@pytest.mark.e2e
@pytest.mark.parametrize("case", PIPELINE_CASES, ids=lambda c: c.name)
def test_1f1b_matches_single_process(world: list[dict], case: Case) -> None:
    """1F1B across different TP degrees completes and gives the single-process gradients
    (summed over TP ranks with SP, where each rank saw only its rows)."""
    plan = case_plan(case)
    tol = {"rtol": 2e-2, "atol": 2e-3} if case.dtype else {"rtol": 1e-5, "atol": 1e-6}
    for d in range(case.dp):
        ref = reference_grads(case, d)
        for s in range(len(case.tps)):
            grads = [torch.from_numpy(world[r][("pipeline", case.name)]["grad"])
                     for r in range(plan.world_size)
                     if plan.rank_coordinates(r)[:2] == (s, d)]
            if case.sp:
                torch.testing.assert_close(sum(grads), ref[s], **tol)
            else:
                for g in grads:
                    torch.testing.assert_close(g, ref[s], **tol)
