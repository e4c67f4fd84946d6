"""Conformance suite for accelerator plug-ins: what megatron_h2 asks of every chip.

Parametrised over every available accelerator (tests/conftest.py): placement,
synchronize, memory statistics, RNG save / restore, autocast dtype, every kernel of its table
against the native fallback, and (at two processes, e2e) its backend's collectives and the
bridge's staging path from its memory. A vendor plug-in passes this file before it trains.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_h2.devices import NATIVE_KERNELS, Kernels, get_accelerator, load_plugins
from megatron_h2.devices.op_replay import TOLERANCES, check_kernels
from megatron_h2.distributed.bridge import Bridge, BridgeConfig
from tests.helpers.cpu2_plugin import CPU2_PLUGIN
from tests.helpers.dist_utils import run_distributed

MIB = 1 << 20


def test_placement(acc_name):
    acc = get_accelerator(acc_name)
    x = torch.ones(4, 4, device=acc.device)
    assert x.device.type == acc.device_type == acc.device.type
    layer = torch.nn.Linear(4, 2).to(acc.device)
    assert all(p.device == x.device for p in layer.parameters())
    assert layer(x).device == x.device
    assert acc.registry_name() == acc_name and acc_name in acc.describe()


def test_synchronize(acc_name):
    acc = get_accelerator(acc_name)
    x = torch.full((256, 256), 0.5, device=acc.device)
    y = x @ x  # queued asynchronously on accelerators
    acc.synchronize()
    assert torch.equal(y.cpu(), torch.full((256, 256), 64.0))


def test_memory_stats(acc_name):
    acc = get_accelerator(acc_name)
    acc.reset_peak_memory()
    before = acc.memory_stats()
    assert all(isinstance(v, float) and v >= 0 for v in before.values())
    if not before:  # a chip without memory statistics says so with an empty dict
        assert acc_name == "cpu"
        return
    block = torch.ones(64 * MIB // 4, device=acc.device)  # 64 MiB, touched
    acc.synchronize()
    during = acc.memory_stats()
    assert during["allocated_gib"] - before["allocated_gib"] >= 60 / 1024
    assert during["peak_gib"] >= during["allocated_gib"]
    del block


def test_rng_save_and_restore(acc_name):
    acc = get_accelerator(acc_name)
    acc.manual_seed(123)
    cpu_state, dev_state = torch.get_rng_state(), acc.get_rng_state()
    first = torch.rand(64, device=acc.device)
    torch.set_rng_state(cpu_state)
    acc.set_rng_state(dev_state)
    assert torch.equal(torch.rand(64, device=acc.device), first)
    acc.manual_seed(123)
    assert torch.equal(torch.rand(64, device=acc.device), first)
    acc.manual_seed(124)
    assert not torch.equal(torch.rand(64, device=acc.device), first)


def test_autocast_dtype(acc_name):
    acc = get_accelerator(acc_name)
    a = torch.ones(8, 8, device=acc.device)
    with acc.autocast(True):
        assert (a @ a).dtype == acc.autocast_dtype
    with acc.autocast(False):
        assert (a @ a).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_kernel_matches_its_native_fallback(acc_name, dtype):
    acc = get_accelerator(acc_name)
    records = check_kernels(acc.kernels, acc.device, dtype)
    assert {r.op.split("[")[0] for r in records} == {f"kernel.{s}" for s in NATIVE_KERNELS}
    assert len(records) == 2 * len(NATIVE_KERNELS)  # forward and backward of each
    failed = [f"{r.op}: {r.tol_ratio:.3g} x tolerance" for r in records if r.status != "pass"]
    assert not failed, failed


def test_the_kernel_check_catches_a_wrong_kernel():
    """The check above can fail: SwiGLU with its halves swapped, forward and backward."""
    def swapped(x):
        up, gate = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    records = check_kernels(Kernels(swiglu=swapped), "cpu", torch.float32)
    status = {r.op: r.status for r in records}
    assert status["kernel.swiglu[native]"] == "fail"
    assert status["kernel.swiglu[native].backward"] == "fail"
    assert TOLERANCES[torch.float32].rtol < 1e-5


# ----------------------------------------------------------------- two processes (e2e)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _collectives_worker(rank: int, world: int, acc_name: str) -> dict:
    load_plugins()  # the plug-in reaches this process through $MEGATRON_H2_PLUGINS
    acc = get_accelerator(acc_name, rank % max(1, _device_count(acc_name)))
    dev = acc.device
    out: dict[str, object] = {}
    x = torch.arange(4, dtype=torch.float32, device=dev) + 10 * rank
    reduced = x.clone()
    dist.all_reduce(reduced)
    out["all_reduce"] = reduced.cpu().tolist()
    gathered = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(gathered, x)
    out["all_gather"] = torch.cat(gathered).cpu().tolist()
    flat = torch.empty(4 * world, device=dev)
    _all_gather(flat, x)
    out["all_gather_flat"] = flat.cpu().tolist()
    part = torch.empty(4 // world, device=dev)
    _reduce_scatter(part, x)
    out["reduce_scatter"] = part.cpu().tolist()
    peer = 1 - rank
    got = torch.empty(3, device=dev, dtype=torch.bfloat16)
    send = torch.tensor([1.5, 2.5, rank], device=dev, dtype=torch.bfloat16)
    ops = [dist.P2POp(dist.irecv, got, peer), dist.P2POp(dist.isend, send, peer)]
    for work in dist.batch_isend_irecv(ops if rank == 0 else ops[::-1]):
        work.wait()
    out["p2p"] = got.float().cpu().tolist()
    out["bridge"] = _bridge_round_trip(rank, acc)
    return out


def _device_count(acc_name: str) -> int:
    mod = getattr(torch, get_accelerator(acc_name).device_type, None)
    return mod.device_count() if mod is not None and hasattr(mod, "device_count") else 1


def _bridge_round_trip(rank: int, acc) -> list:
    """The bridge's staging path (device -> host buffers -> gloo chunks -> device), fp32 and
    with the bf16 wire, tiny chunks so every transfer is several messages."""
    group = dist.new_group(backend="gloo")
    results = []
    for wire in (None, torch.bfloat16):
        bridge = Bridge(group, acc.device, BridgeConfig(dtype=wire, chunk_mb=1e-4),
                        staged=True)
        tensor = torch.linspace(-3, 3, 2 * 7 * 16, device=acc.device).view(2, 7, 16) + rank
        sends, recvs = bridge.post([(tensor, 1 - rank)], [((2, 7, 16), torch.float32, 1 - rank)])
        got = recvs[0].wait()
        for handle in sends:
            handle.wait()
        bridge.close()
        want = (torch.linspace(-3, 3, 2 * 7 * 16).view(2, 7, 16) + (1 - rank))
        if wire is not None:
            want = want.to(wire).float()
        results.append((str(got.device.type), got.dtype == torch.float32,
                        torch.equal(got.cpu(), want), bridge.stats.chunks))
    return results


@pytest.mark.e2e
def test_collectives_and_bridge_staging_at_two_processes(acc_name, monkeypatch):
    acc = get_accelerator(acc_name)
    if acc.dist_backend == "nccl" and _device_count(acc_name) < 2:
        pytest.skip("NCCL needs one device per process: this machine has one")
    monkeypatch.setenv("MEGATRON_H2_PLUGINS", CPU2_PLUGIN)
    res = run_distributed(_collectives_worker, 2, acc_name, backend=acc.dist_backend,
                          timeout=120)
    for rank, r in enumerate(res):
        assert r["all_reduce"] == [10.0, 12.0, 14.0, 16.0]
        assert r["all_gather"] == r["all_gather_flat"] == [0.0, 1, 2, 3, 10, 11, 12, 13]
        assert r["reduce_scatter"] == [[10.0, 12.0], [14.0, 16.0]][rank]
        assert r["p2p"] == [1.5, 2.5, float(1 - rank)]
        for device_type, fp32, equal, chunks in r["bridge"]:
            assert (device_type, fp32, equal) == (acc.device_type, True, True)
            assert chunks >= 5  # the tensor crossed in several chunks
