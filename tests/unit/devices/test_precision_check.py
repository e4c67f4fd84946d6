"""Operator precision alignment (tools/precision_check.py and megatron_h2.devices.op_replay):
every operator of a training step replayed on a reference, wrong kernels named."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron_h2.devices import CPUAccelerator, Kernels, register_accelerator
from megatron_h2.devices.accelerator import unregister_accelerator
from megatron_h2.devices.op_replay import (
    ModuleStack,
    PrecisionCapture,
    Tolerance,
    compare,
    sdpa_reference_backward,
    sdpa_reference_forward,
)
from tests.helpers.paths import ROOT

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "32",
        "--vocab-size", "256", "--micro-batch-size", "2"]


def _tool():
    spec = importlib.util.spec_from_file_location("precision_check",
                                                  ROOT / "tools" / "precision_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_tool(tmp_path: Path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "report.json"
    rc = _tool().main([*TINY, *extra, "--output", str(out)])
    return rc, json.loads(out.read_text())


def _wrong_eps_rms_norm(x, weight, eps):
    return F.rms_norm(x, (x.shape[-1],), weight, eps * 10)  # a vendor kernel with eps wrong


def _swapped_swiglu(x):
    up, gate = x.chunk(2, dim=-1)  # gate and up halves swapped
    return F.silu(gate) * up


def _vendor(name: str, slot: str, kernel, label: str) -> type[CPUAccelerator]:
    """A CPU accelerator plug-in whose kernel table has ``kernel`` in ``slot``."""
    names = {"rms_norm": "native", "swiglu": "native", "adamw": "foreach", slot: label}
    table = Kernels(**{slot: kernel}, names=names)
    return type(f"{name}Accelerator", (CPUAccelerator,),
                {"name": name, "auto_detect": False, "build_kernels": lambda self: table})


WRONG_VENDORS = (_vendor("wrongnorm", "rms_norm", _wrong_eps_rms_norm, "wrong-eps"),
                 _vendor("swappedswiglu", "swiglu", _swapped_swiglu, "swapped"))


@pytest.fixture
def wrong_vendors():
    for cls in WRONG_VENDORS:
        register_accelerator(cls)
    yield
    for cls in WRONG_VENDORS:
        unregister_accelerator(cls.name)


def test_bf16_against_fp32_reports_every_operator(tmp_path, capsys):
    plot = tmp_path / "errors.png"
    rc, report = run_tool(tmp_path, "--dtype", "bf16", "--reference-dtype", "fp32",
                          "--plot", str(plot))
    printed = capsys.readouterr().out
    assert rc == 0 and "first divergence: none" in printed
    ops = report["operators"]
    assert report["summary"]["operators"] == len(ops) > 400
    assert [r["index"] for r in ops] == list(range(len(ops)))  # nothing left out
    names = {r["op"] for r in ops}
    assert {"aten.mm.default", "aten._to_copy.default", "aten.embedding_dense_backward.default",
            "aten._log_softmax_backward_data.default", "kernel.rms_norm[native]",
            "kernel.swiglu[native].backward"} <= names
    assert any(n.startswith("aten._scaled_dot_product") and n.endswith("_backward.default")
               for n in names)
    assert {r["phase"] for r in ops} == {"forward", "backward", "optimizer"}
    skipped = {r["op"] for r in ops if r["status"] == "skipped"}
    assert all(n.startswith("profiler.") for n in skipped), skipped
    bf16 = [r for r in ops if r["dtype"] == "bfloat16" and r["status"] == "pass"]
    assert bf16 and max(r["max_abs"] for r in bf16) > 0  # bf16 really differs from fp32
    modules = {r["module"] for r in ops}
    assert {"decoder.layers.1.mlp.linear_fc2", "decoder.layers.0.self_attention.rotary",
            "embedding.word_embeddings", "output_layer"} <= modules
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fp32_against_fp64_is_within_tolerance(tmp_path):
    rc, report = run_tool(tmp_path)  # defaults: --dtype fp32 --reference-dtype fp64
    assert rc == 0 and report["first_divergence"] is None
    compared = [r for r in report["operators"] if r["status"] != "skipped"]
    assert len(compared) > 400 and all(r["status"] == "pass" for r in compared)
    assert max(r["max_abs"] for r in compared) > 0  # the fp64 replay is really different


@pytest.mark.parametrize("device, op, module", [
    ("wrongnorm", "kernel.rms_norm[wrong-eps]", "decoder.layers.0.input_layernorm"),
    ("swappedswiglu", "kernel.swiglu[swapped]", "decoder.layers.0.mlp"),
])
def test_a_wrong_kernel_is_the_first_divergence(device, op, module, wrong_vendors, tmp_path,
                                               capsys):
    rc, report = run_tool(tmp_path, "--device", device)
    assert rc == 1
    first = report["first_divergence"]
    assert (first["op"], first["module"], first["phase"]) == (op, module, "forward")
    assert first["tol_ratio"] > 100
    earlier = [r for r in report["operators"] if r["index"] < first["index"]]
    assert all(r["status"] != "fail" for r in earlier)
    assert f"first divergence: #{first['index']} {op} (forward) in {module}" in \
        capsys.readouterr().out


def test_one_stage_of_a_plan(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("data_parallel_size: 1\nmicro_batch_size: 2\nglobal_batch_size: 2\n"
                    "chips: {a: {device: cpu}, b: {device: cpu}}\nstages:\n"
                    "  - {chip: a, tensor_parallel_size: 1, num_layers: 1}\n"
                    "  - {chip: b, tensor_parallel_size: 1, num_layers: 1}\n")
    rc, report = run_tool(tmp_path, "--hetero-plan", str(plan), "--stage", "1")
    assert rc == 0 and report["layers"] == "1-1"
    layers = {r["layer"] for r in report["operators"]}
    assert "layer 1" in layers and "layer 0" not in layers and "embedding" not in layers
    assert _tool().main([*TINY, "--stage", "1"]) == 2  # --stage needs a plan


def test_compare_judges_errors_against_the_tensor_scale():
    tol = Tolerance(rtol=1e-2, atol=1e-5)
    ref = torch.tensor([1.0, 1e-3, -2.0])
    ok = compare([ref + torch.tensor([0.005, 0.005, 0.0])], [ref], torch.float32, tol)
    assert ok["status"] == "pass" and ok["max_rel"] == pytest.approx(5.0, rel=1e-3)
    bad = compare([ref + torch.tensor([0.0, 0.0, 0.05])], [ref], torch.float32, tol)
    assert bad["status"] == "fail" and bad["tol_ratio"] == pytest.approx(0.05 / 0.02001, 1e-3)
    nan = compare([torch.tensor([float("nan")])], [torch.tensor([1.0])], torch.float32, tol)
    assert nan["status"] == "fail"
    ints = compare([torch.tensor([1, 2])], [torch.tensor([1, 3])], torch.int64, tol)
    assert ints["status"] == "fail"
    one_ulp = compare([torch.tensor([1.0 + 2**-23])], [torch.tensor([1.0])], torch.float32, tol)
    assert one_ulp["max_ulp"] == pytest.approx(1.0)


def test_in_place_operators_are_compared_through_their_inputs():
    params = [torch.ones(3), torch.ones(2)]
    with PrecisionCapture() as capture:
        torch._foreach_mul_(params, 1.1)
    (record,) = capture.records
    assert record.op == "aten._foreach_mul_.Scalar" and record.status == "pass"
    assert record.shape == [[3], [2]] and record.max_abs > 0  # fp32 1.1 vs fp64 1.1


def test_module_stack_names_backward_operators():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 2)))
    stack = ModuleStack(model)
    with stack, PrecisionCapture(modules=stack) as capture:
        model(torch.randn(3, 4)).sum().backward()
    mms = [(r.phase, r.module) for r in capture.records if r.op == "aten.mm.default"]
    assert ("backward", "1.0") in mms and ("backward", "0") in mms
    assert [m for p, m in mms if p == "backward"][0] == "1.0"  # the last layer first


@pytest.mark.parametrize("causal", [False, True])
def test_fused_attention_replays_through_the_math_kernel(causal):
    """The path that replays device-only attention kernels (CUDA flash / efficient) on the
    reference, checked against the CPU flash kernel here."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    out, lse = flash(q, k, v, 0.0, causal)
    (ref,) = sdpa_reference_forward(flash, (q, k, v, 0.0, causal), {})
    torch.testing.assert_close(ref, out)
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    want = backward(grad, q, k, v, out, lse, 0.0, causal)
    got = sdpa_reference_backward(backward, (grad, q, k, v, out, lse, 0.0, causal), {})
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_cuda_attention_schemas_bind_to_the_math_replay():
    """CUDA's fused attention operators cannot run here, but their replay only reads their
    schemas: the efficient kernel's (grad_out_, attn_bias) and flash's argument names."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    efficient = torch.ops.aten._scaled_dot_product_efficient_attention.default
    (got,) = sdpa_reference_forward(efficient, (q, k, v, None, True, 0.0, True), {})
    torch.testing.assert_close(got, want)
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    (got,) = sdpa_reference_forward(flash, (q, k, v, 0.0, True, False), {"scale": None})
    torch.testing.assert_close(got, want)
    grad = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad(F.scaled_dot_product_attention(*leaves, is_causal=True),
                                   leaves, grad)
    backward = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default
    args = (grad, q, k, v, None, want, torch.empty(0), torch.empty(0), torch.empty(0), 0.0,
            [True, True, True, False], True)
    for g, e in zip(sdpa_reference_backward(backward, args, {}), expected):
        torch.testing.assert_close(g, e)


def test_indices_of_a_floating_reduction_are_not_judged():
    """max over a tie: fp32 and fp64 may pick different indices, the values are what counts."""
    x = torch.tensor([[1.0, 1.0 + 2**-30, 0.5]])  # equal in fp32, not in fp64
    with PrecisionCapture() as capture:
        torch.max(x, dim=1)
    (record,) = capture.records
    assert record.op == "aten.max.dim" and record.status == "pass"
    assert record.shape == [[1]] and record.dtype == "float32"
