"""DiComm pipeline bridge, without processes: transfer plans between stages of different TP
degree, simulated in memory; the bridge's configuration checks; which boundaries PipeComm bridges
and the shapes it moves. (Transfers and PipeComm under the 1F1B schedule in a gloo world:
tests/e2e/test_bridge.py.)
"""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_h2.distributed.boundary import (
    BoundaryPlan,
    Transfer,
    boundary_plan,
    local_rows,
    rank_boundaries,
)
from megatron_h2.distributed.bridge import BridgeConfig
from megatron_h2.distributed.p2p import PipeComm
from megatron_h2.distributed.topology import Topology
from megatron_h2.errors import ConfigError
from megatron_h2.plan.schema import ChipSpec, HeteroPlan, StageSpec

MBS, SEQ, HIDDEN = 2, 8, 16
TPS = (1, 2, 4)


def make_plan(tps: tuple[int, ...], dp: int, micro: int = 3,
              devices: tuple[str, ...] | None = None) -> HeteroPlan:
    devices = devices or ("cpu",) * len(tps)
    chips = {f"c{s}": ChipSpec(device=d) for s, d in enumerate(devices)}
    return HeteroPlan(data_parallel_size=dp, micro_batch_size=MBS,
                      global_batch_size=MBS * dp * micro, chips=chips,
                      stages=[StageSpec(chip=f"c{s}", tensor_parallel_size=t, num_layers=1)
                              for s, t in enumerate(tps)])


def make_topo(plan: HeteroPlan, rank: int) -> Topology:
    stage, dp_rank, tp_rank = plan.rank_coordinates(rank)
    return Topology(plan=plan, rank=rank, world_size=plan.world_size, stage=stage,
                    dp_rank=dp_rank, tp_rank=tp_rank)


def rows_of(plan: HeteroPlan, rank: int, sp: bool) -> slice:
    stage, _, tp_rank = plan.rank_coordinates(rank)
    return local_rows(SEQ, plan.stages[stage].tensor_parallel_size, tp_rank, sp)


def global_tensor(seed: int, *key: int) -> torch.Tensor:
    """The full [MBS, SEQ, HIDDEN] tensor crossing one boundary for one replica / micro-batch."""
    gen = torch.Generator().manual_seed(hash((seed, *key)) % (2**31))
    return torch.randn(MBS, SEQ, HIDDEN, generator=gen)


def simulate(plan: HeteroPlan, sp: bool, forward: bool) -> dict[int, torch.Tensor]:
    """Move one tensor per boundary through every rank's plan in memory; return what each
    receiving rank (forward) or sending rank (backward) assembled."""
    plans = {r: rank_boundaries(plan, r, SEQ, sp) for r in range(plan.world_size)}
    got: dict[int, torch.Tensor] = {}
    for r in range(plan.world_size):
        stage, d, _ = plan.rank_coordinates(r)
        side = plans[r][0] if forward else plans[r][1]
        if side is None:
            continue
        boundary = stage - 1 if forward else stage
        rows = rows_of(plan, r, sp)
        out = torch.full((MBS, rows.stop - rows.start, HIDDEN), float("nan"))
        filled = torch.zeros(rows.stop - rows.start, dtype=torch.int64)
        for tr in (side.fwd_recv if forward else side.bwd_recv):
            peer_side = plans[tr.peer][1] if forward else plans[tr.peer][0]
            peer_list = peer_side.fwd_send if forward else peer_side.bwd_send
            mirror = [t for t in peer_list if t.peer == r]
            assert mirror == [Transfer(r, tr.remote, tr.local)], (r, tr, peer_list)
            peer_full = global_tensor(0, boundary, d, int(forward))
            peer_local = peer_full[:, rows_of(plan, tr.peer, sp)]
            out[:, tr.local] = peer_local[:, tr.remote]
            filled[tr.local] += 1
        assert torch.equal(filled, torch.ones_like(filled)), (r, filled)
        got[r] = out
    return got


@pytest.mark.parametrize("a,b", list(itertools.product(TPS, TPS)))
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("dp", [1, 2])
def test_plans_deliver_every_row_once(a: int, b: int, sp: bool, dp: int) -> None:
    plan = make_plan((a, b, a), dp)
    for forward in (True, False):
        got = simulate(plan, sp, forward)
        for r, tensor in got.items():
            stage, d, _ = plan.rank_coordinates(r)
            boundary = stage - 1 if forward else stage
            want = global_tensor(0, boundary, d, int(forward))[:, rows_of(plan, r, sp)]
            assert torch.equal(tensor, want), (r, forward)
        receivers = [r for r in range(plan.world_size)
                     if plan.rank_coordinates(r)[0] == (1 if forward else 0)]
        assert set(receivers) <= set(got)


@pytest.mark.parametrize("a,b", list(itertools.product(TPS, TPS)))
def test_replicated_plan_partners(a: int, b: int) -> None:
    """Without SP: receiver j <- sender j % a; sender i <- gradient of receiver i % b."""
    senders, receivers = list(range(a)), list(range(a, a + b))
    for i, r in enumerate(senders):
        p = boundary_plan(senders, receivers, r, SEQ, False)
        assert p.bwd_recv == (Transfer(receivers[i % b], slice(0, SEQ), slice(0, SEQ)),)
        assert [t.peer for t in p.fwd_send] == [receivers[j] for j in range(b) if j % a == i]
        assert p.fwd_recv == () and p.bwd_send == ()
    for j, r in enumerate(receivers):
        p = boundary_plan(senders, receivers, r, SEQ, False)
        assert [t.peer for t in p.fwd_recv] == [senders[j % a]]
        assert [t.peer for t in p.bwd_send] == [senders[i] for i in range(a) if i % b == j]


def test_sequence_parallel_plan_slices() -> None:
    # 4 -> 2, seq 8: receiver 0 (rows 0-3) takes rows 0-1 of sender 0 and rows 0-1 of sender 1
    p = boundary_plan([0, 1, 2, 3], [4, 5], 4, SEQ, True)
    assert p.fwd_recv == (Transfer(0, slice(0, 2), slice(0, 2)),
                          Transfer(1, slice(2, 4), slice(0, 2)))
    assert p.bwd_send == p.fwd_recv
    # 2 -> 4: sender 1 (rows 4-7) feeds receivers 2 (rows 4-5) and 3 (rows 6-7)
    p = boundary_plan([0, 1], [2, 3, 4, 5], 1, SEQ, True)
    assert p.fwd_send == (Transfer(4, slice(0, 2), slice(0, 2)),
                          Transfer(5, slice(2, 4), slice(0, 2)))
    assert p.bwd_recv == p.fwd_send


def test_plan_errors() -> None:
    with pytest.raises(ConfigError, match="divisible"):
        boundary_plan([0, 1, 2], [3], 0, 8, True)
    with pytest.raises(ConfigError, match="neither side"):
        boundary_plan([0], [1], 2, 8, False)
    with pytest.raises(ConfigError, match="both sides"):
        boundary_plan([0, 1], [1], 0, 8, False)
    assert rank_boundaries(make_plan((2,), 1), 1, SEQ, True) == (None, None)
    assert isinstance(rank_boundaries(make_plan((1, 2), 1), 0, SEQ, True)[1], BoundaryPlan)


def test_bridge_config_checks() -> None:
    with pytest.raises(ConfigError, match="chunk_mb"):
        BridgeConfig(chunk_mb=0)
    with pytest.raises(ConfigError, match="dtype"):
        BridgeConfig(dtype=torch.int32)
    assert BridgeConfig(chunk_mb=1).chunk_elements(4) == 1 << 18
    assert BridgeConfig(chunk_mb=1e-9).chunk_elements(4) == 1


def test_paths_and_shapes_follow_devices() -> None:
    """Bridge where device types differ (or forced), direct elsewhere; local shapes per SP."""
    plan = make_plan((2, 1, 4), 1, devices=("cuda", "cuda:1", "npu"))
    group = object()  # never used: constructing a PipeComm communicates nothing
    comm = PipeComm(make_topo(plan, 2), MBS, SEQ, HIDDEN, True, torch.float32,
                    torch.device("cpu"), BridgeConfig(), group)
    assert comm.paths == {"prev": "direct", "next": "bridge"}
    assert comm.shape == (MBS, SEQ, HIDDEN)
    comm = PipeComm(make_topo(plan, 4), MBS, SEQ, HIDDEN, True, torch.float32,
                    torch.device("cpu"), BridgeConfig(force=True), group)
    assert comm.paths == {"prev": "bridge", "next": None}
    assert comm.shape == (MBS, SEQ // 4, HIDDEN)
    comm = PipeComm(make_topo(plan, 0), MBS, SEQ, HIDDEN, False, torch.float32,
                    torch.device("cpu"), BridgeConfig(), None, devices={0: "cpu", 1: "cpu",
                                                                        2: "cpu"})
    assert comm.paths == {"prev": None, "next": "direct"} and comm.shape == (MBS, SEQ, HIDDEN)
    comm.wait_sends()  # nothing pending
    with pytest.raises(ValueError, match="activation is"):  # before any traffic
        comm.send_forward(torch.zeros(MBS, SEQ // 2, HIDDEN))
    with pytest.raises(ConfigError, match="stages \\[2\\]"):
        PipeComm(make_topo(plan, 0), MBS, SEQ, HIDDEN, False, torch.float32,
                 torch.device("cpu"), BridgeConfig(), None, devices={0: "cpu", 1: "cpu"})
