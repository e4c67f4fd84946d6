"""Conformance suite for accelerator plug-ins, at two processes: each available accelerator's
backend collectives and the bridge's staging path from its memory (parametrised over every
available accelerator, tests/conftest.py; the one-process part is
tests/unit/devices/test_conformance.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_h2.devices import get_accelerator, load_plugins
from megatron_h2.distributed.bridge import Bridge, BridgeConfig
from tests.helpers.cpu2_plugin import CPU2_PLUGIN
from tests.helpers.dist_utils import run_distributed

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
