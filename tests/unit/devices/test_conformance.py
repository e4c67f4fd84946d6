"""Conformance suite for accelerator plug-ins: what megatron_h2 asks of every chip.

Parametrised over every available accelerator (tests/conftest.py): placement,
synchronize, memory statistics, RNG save / restore, autocast dtype, every kernel of its table
against the native fallback. At two processes, its backend's collectives and the bridge's
staging path from its memory: tests/e2e/test_device_conformance.py. A vendor plug-in passes
both files before it trains.
"""

from __future__ import annotations

import pytest
import torch

from megatron_h2.devices import NATIVE_KERNELS, Kernels, get_accelerator
from megatron_h2.devices.op_replay import TOLERANCES, check_kernels

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
