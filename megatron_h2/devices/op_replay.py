"""Operator precision alignment: replay every operator of a step on a reference device / dtype.

Chips of different vendors must compute the same function within tolerance, or a mixed
pipeline trains a different model on each stage. :class:`PrecisionCapture` runs a piece of
training (forward, backward, optimizer step) and, for every ATen operator it executes, replays
the same operator on the *same inputs* converted to a reference device and dtype (default: CPU
fp64), then compares the outputs. Each operator's error is therefore its own, not the sum of
what earlier operators did. Kernel-table functions (``Kernels.rms_norm``, ``Kernels.swiglu``:
possibly vendor kernels that torch cannot see inside) are compared as one unit against their
native fallbacks, forward and backward (:func:`probe_kernels`).

Why a ``TorchDispatchMode`` and not module hooks: a dispatch mode sees every ATen operator
after autograd and autocast have done their work, so it sees the backward's operators (which no
forward hook sees), the casts autocast inserts, in-place optimizer updates, and the kernel torch
actually picked (for instance ``_scaled_dot_product_flash_attention_for_cpu``), each with its
real inputs. Module hooks only see module boundaries. Hooks are used for what they are good at:
:class:`ModuleStack` tells which module each operator belongs to, in forward (module pre / post
hooks) and in backward (gradient hooks on module outputs and inputs), so a divergence is named
with its module (``decoder.layers.1.mlp``).

Per operator a :class:`OpRecord` holds the output shape and dtype, max abs / max rel error, the
distance in units in the last place of the output dtype (ulp) and the ratio of its error to
its tolerance; it passes when ``max |x - ref| <= atol + rtol * max |ref|`` with the output
dtype's :data:`TOLERANCES` (see :class:`Tolerance` for why the scale is the tensor's).
Operators that cannot be compared say why (random, not an ATen operator, uninitialised output,
not runnable on the reference).
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from megatron_h2.devices.kernels import NATIVE_KERNELS, Kernels


@dataclass(frozen=True)
class Tolerance:
    """An output passes when ``max |x - ref| <= atol + rtol * max |ref|`` over the tensor.

    The error is judged against the scale of the whole tensor, not of each element:
    accumulations (matmul, attention, sums) lose precision relative to the size of their terms,
    so an element that nearly cancels to zero legitimately carries an error of order
    ``rtol * scale``. The elementwise relative error and the ulp distance are reported beside.
    The values are torch.testing's defaults for each dtype.
    """

    rtol: float
    atol: float


TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(1e-7, 1e-7), torch.float32: Tolerance(1.3e-6, 1e-5),
    torch.bfloat16: Tolerance(1.6e-2, 1e-5), torch.float16: Tolerance(1e-3, 1e-5)}
"""Tolerance by the dtype of the operator's output on the checked device."""

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16,
          "fp16": torch.float16}
_UNINITIALISED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                  "empty_permuted", "resize_"}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


@dataclass
class OpRecord:
    """One operator (or kernel-table function) call and how far it is from the reference."""

    index: int  # execution order (a kernel comes before the operators inside it)
    op: str  # e.g. "aten.mm.default" or "kernel.rms_norm[native]"
    kind: str  # "op" or "kernel"
    phase: str  # "forward", "backward" or "optimizer"
    module: str  # qualified name of the innermost module running ("" = outside every module)
    shape: list[list[int]] = field(default_factory=list)  # shapes of the compared outputs
    dtype: str = ""  # dtype of the (first) output on the checked device
    max_abs: float | None = None
    max_rel: float | None = None  # |x - ref| / max(|ref|, atol)
    max_ulp: float | None = None  # |x - ref| in ulp of the output dtype at max(|ref|, atol)
    tol_ratio: float | None = None  # max |x - ref| / (atol + rtol max |ref|): > 1 fails
    status: str = "pass"  # "pass", "fail" or "skipped"
    note: str = ""

    @property
    def layer(self) -> str:
        """``"layer 3"``, ``"embedding"``, ``"head"`` (final norm, output layer) or ``"other"``."""
        match = _LAYER.search(self.module)
        if match:
            return f"layer {match.group(1)}"
        if self.module.startswith("embedding"):
            return "embedding"
        if self.module.startswith(("decoder.final_layernorm", "output_layer")):
            return "head"
        return "other"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "layer": self.layer}


# ------------------------------------------------------------------------------- comparing
def _ulp(ref: torch.Tensor, dtype: torch.dtype, floor: float) -> torch.Tensor:
    """Spacing of ``dtype`` numbers at max(|ref|, floor) (float64 tensor)."""
    info = torch.finfo(dtype)
    _, exponent = torch.frexp(ref.abs().clamp(min=max(info.tiny, floor)))
    return torch.ldexp(torch.full_like(ref, info.eps), exponent - 1)


def compare(got: list[torch.Tensor], ref: list[torch.Tensor], dtype: torch.dtype,
            tol: Tolerance) -> dict[str, Any]:
    """Errors of ``got`` (the checked device's outputs) against ``ref``, in float64. NaN and
    infinities must sit at the same places in both."""
    max_abs = max_rel = max_ulp = ratio = 0.0
    for g, r in zip(got, ref):
        if tuple(g.shape) != tuple(r.shape):
            return {"status": "fail", "note": f"shape {tuple(g.shape)} != reference "
                    f"{tuple(r.shape)}", "max_abs": math.inf, "tol_ratio": math.inf}
        g64, r64 = g.detach().to("cpu", torch.float64), r.detach().to("cpu", torch.float64)
        if g64.numel() == 0 or torch.equal(g64, r64):
            continue  # exactly equal (views, copies, exact arithmetic): nothing to measure
        diff = (g64 - r64).abs()
        if not bool(torch.isfinite(diff).all()):
            finite = torch.isfinite(g64) & torch.isfinite(r64)
            same = (g64 == r64) | (torch.isnan(g64) & torch.isnan(r64))
            if not bool((finite | same).all()):
                max_abs = ratio = math.inf
            g64, r64, diff = g64[finite], r64[finite], diff[finite]
            if diff.numel() == 0:
                continue
        worst, scale = float(diff.max()), r64.abs()
        max_abs = max(max_abs, worst)
        if dtype.is_floating_point:
            max_rel = max(max_rel, float((diff / scale.clamp(min=tol.atol)).max()))
            ulp_dtype = dtype if dtype in TOLERANCES else torch.float64
            max_ulp = max(max_ulp, float((diff / _ulp(r64, ulp_dtype, tol.atol)).max()))
            ratio = max(ratio, worst / (tol.atol + tol.rtol * float(scale.max())))
        elif worst > 0:
            ratio = math.inf
    out = {"status": "pass" if ratio <= 1.0 else "fail", "max_abs": max_abs,
           "tol_ratio": ratio}
    if dtype.is_floating_point:
        out.update(max_rel=max_rel, max_ulp=max_ulp)
    return out


def _tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor (and Python number, as a 0-d tensor) in an output structure."""
    out = []
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif isinstance(leaf, (bool, int, float)):
            out.append(torch.tensor(leaf, dtype=torch.float64))
    return out


# --------------------------------------------------------------------------- module names
class ModuleStack:
    """Which module of ``root`` is running: forward pre / post hooks push and pop, and in
    backward a module is entered when its outputs' gradients are ready and left when its
    inputs' are (multi-gradient hooks, as ``torch.utils.module_tracker`` does). A module
    shared by several parents (one rotary embedding for every layer) is named after the
    parent that calls it."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self._first_name = {m: n for n, m in reversed(list(root.named_modules()))}
        self._children: dict[nn.Module, dict[nn.Module, str]] = {}
        self._forward: list[tuple[nn.Module, str]] = []
        self._backward: list[str] = []
        self._handles: list[Any] = []

    @property
    def current(self) -> str:
        """The innermost running module. In backward that is the deepest one entered and not
        left (a module and its last child share an output tensor, so their gradient hooks
        fire together, in no useful order)."""
        if torch._C._current_graph_task_id() != -1 and self._backward:
            return max(enumerate(self._backward),
                       key=lambda item: (item[1].count(".") + bool(item[1]), item[0]))[1]
        return self._forward[-1][1] if self._forward else ""

    def _name(self, module: nn.Module) -> str:
        if self._forward:
            parent, parent_name = self._forward[-1]
            if parent not in self._children:
                self._children[parent] = {m: n for n, m in parent.named_children()}
            child = self._children[parent].get(module)
            if child is not None:
                return f"{parent_name}.{child}" if parent_name else child
        return self._first_name[module]

    def _pre(self, module: nn.Module, args: Any) -> None:
        if module not in self._first_name:
            return
        name = self._name(module)
        self._forward.append((module, name))
        needs = _graph_tensors(args)
        if needs:
            self._handles.append(register_multi_grad_hook(needs, lambda _g: self._leave(name)))

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if module not in self._first_name or not self._forward:
            return
        _, name = self._forward.pop()
        needs = _graph_tensors(output)
        if needs:
            self._handles.append(register_multi_grad_hook(
                needs, lambda _g: self._backward.append(name)))

    def _leave(self, name: str) -> None:
        for i in range(len(self._backward) - 1, -1, -1):
            if self._backward[i] == name:
                del self._backward[i]
                return

    def __enter__(self) -> ModuleStack:
        self._handles += [nn.modules.module.register_module_forward_pre_hook(self._pre),
                          nn.modules.module.register_module_forward_hook(self._post)]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._forward, self._backward = [], [], []


def _graph_tensors(value: Any) -> list[torch.Tensor]:
    """Non-leaf tensors that need grad (gradient hooks on leaves fail under autograd.grad)."""
    return [t for t in tree_flatten(value)[0]
            if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None]


# ---------------------------------------------------------------------------- the capture
class PrecisionCapture(TorchDispatchMode):
    """Replays every ATen operator run under it on ``reference`` device / ``reference_dtype``
    and records the difference (see the module docstring). ``modules`` names the module of
    each operator; ``phase`` may be set by the caller (e.g. ``"optimizer"``), else it is
    ``forward`` or ``backward``. ``max_records`` bounds memory on big models (later operators
    are still executed, only not recorded)."""

    def __init__(self, reference: torch.device | str = "cpu",
                 reference_dtype: torch.dtype = torch.float64,
                 modules: ModuleStack | None = None,
                 tolerances: dict[torch.dtype, Tolerance] | None = None,
                 max_records: int = 1_000_000) -> None:
        super().__init__()
        self.reference, self.reference_dtype = torch.device(reference), reference_dtype
        self.modules, self.tolerances = modules, dict(tolerances or TOLERANCES)
        self.records: list[OpRecord] = []
        self.phase: str | None = None
        self.max_records = max_records
        self._paused = 0
        self._next = 0

    # ------------------------------------------------------------------------- helpers
    def tolerance(self, dtype: torch.dtype) -> Tolerance:
        return self.tolerances.get(dtype, self.tolerances[torch.float64])

    def current_phase(self) -> str:
        if self.phase is not None:
            return self.phase
        return "backward" if torch._C._current_graph_task_id() != -1 else "forward"

    def new_record(self, op: str, kind: str) -> OpRecord:
        record = OpRecord(index=self._next, op=op, kind=kind, phase=self.current_phase(),
                          module=self.modules.current if self.modules else "")
        self._next += 1
        if len(self.records) < self.max_records:
            self.records.append(record)
        return record

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Run a block without capturing (the reference computations of kernels)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def to_reference(self, value: Any) -> Any:
        """A tensor / dtype / device argument as the reference sees it (copies tensors)."""
        if isinstance(value, torch.Tensor):
            dtype = self.reference_dtype if value.is_floating_point() else value.dtype
            return value.detach().to(self.reference, dtype, copy=True)
        if isinstance(value, torch.dtype) and value.is_floating_point:
            return self.reference_dtype
        if isinstance(value, torch.device):
            return self.reference
        return value

    def fill(self, record: OpRecord, got: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
        """Compare and store the result in ``record``."""
        if not got:
            record.status, record.note = "skipped", "no tensor output"
            return
        if any(t.is_floating_point() for t in got):  # max.dim & co: indices may differ on ties
            pairs = [(g, r) for g, r in zip(got, ref) if g.is_floating_point()]
            got, ref = [g for g, _ in pairs], [r for _, r in pairs]
        dtype = got[0].dtype
        record.shape = [list(t.shape) for t in got]
        record.dtype = str(dtype).removeprefix("torch.")
        for key, value in compare(got, ref, dtype, self.tolerance(dtype)).items():
            setattr(record, key, value)

    # ---------------------------------------------------------------------- dispatching
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._paused:
            return func(*args, **kwargs)
        record = self.new_record(str(func), "op")
        skip = self._skip_reason(func, args, kwargs)
        if skip:
            record.status, record.note = "skipped", skip
            return func(*args, **kwargs)
        ref_args, ref_kwargs = tree_map(self.to_reference, (args, kwargs))  # before in-place ops
        out = func(*args, **kwargs)
        try:
            ref_out = _replay(func, ref_args, ref_kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure: this op is not replayable there
            record.status = "skipped"
            record.note = f"not runnable on {self.reference} {self.reference_dtype}: " \
                          f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            return out
        got, ref = _tensors(out), _tensors(ref_out)
        if not got:  # in-place operators without a result (torch._foreach_add_): the inputs
            written = _written_args(func)
            got = [t for i in written for t in _tensors(args[i])]
            ref = [t for i in written for t in _tensors(ref_args[i])]
        self.fill(record, got, ref)
        return out

    @staticmethod
    def _skip_reason(func, args: tuple, kwargs: dict) -> str:
        namespace = func.namespace
        if namespace != "aten":
            return f"not an ATen operator ({namespace}): not replayed"
        if torch.Tag.nondeterministic_seeded in func.tags and not _no_dropout(func, args, kwargs):
            return "random: not comparable"
        if func.overloadpacket.__name__ in _UNINITIALISED:
            return "uninitialised output: not compared"
        return ""


def _no_dropout(func, args: tuple, kwargs: dict) -> bool:
    """A seeded operator that draws nothing: attention with ``dropout_p == 0``."""
    bound = _bind(func, args, kwargs)
    return "dropout_p" in bound and bound["dropout_p"] == 0


def _written_args(func) -> list[int]:
    return [i for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write]


# ------------------------------------------------------- replays of device-only operators
def _bind(func, args: tuple, kwargs: dict) -> dict[str, Any]:
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    for a in func._schema.arguments:
        if a.name not in bound and a.has_default_value():
            bound[a.name] = a.default_value
    return bound


def _sdpa_math(q, k, v, bound: dict[str, Any]) -> torch.Tensor:
    scale = bound.get("scale")
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=bound.get("attn_bias", bound.get("attn_mask")),
        is_causal=bool(bound.get("is_causal", False)), scale=scale,
        enable_gqa=q.shape[-3] != k.shape[-3])


def sdpa_reference_forward(func, args: tuple, kwargs: dict) -> tuple[torch.Tensor, ...]:
    """Fused attention forward (flash / efficient / cuDNN / CPU flash) through the math
    implementation; only the attention output (the first result) is produced."""
    bound = _bind(func, args, kwargs)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return (_sdpa_math(bound["query"], bound["key"], bound["value"], bound),)


def sdpa_reference_backward(func, args: tuple, kwargs: dict) -> tuple[torch.Tensor, ...]:
    """Fused attention backward through autograd of the math implementation:
    (grad_query, grad_key, grad_value)."""
    bound = _bind(func, args, kwargs)
    q, k, v = (bound[n].detach().requires_grad_() for n in ("query", "key", "value"))
    with torch.enable_grad(), torch.nn.attention.sdpa_kernel(
            torch.nn.attention.SDPBackend.MATH):
        out = _sdpa_math(q, k, v, bound)
        grad = bound["grad_out"] if "grad_out" in bound else bound["grad_out_"]  # efficient
        return torch.autograd.grad(out, (q, k, v), grad)


def _replay(func, args: tuple, kwargs: dict) -> Any:
    name = func.overloadpacket.__name__
    try:
        return func(*args, **kwargs)
    except (NotImplementedError, RuntimeError):
        if name.startswith("_scaled_dot_product") and name.endswith("_backward"):
            return sdpa_reference_backward(func, args, kwargs)
        if name.startswith("_scaled_dot_product"):
            return sdpa_reference_forward(func, args, kwargs)
        raise


# ------------------------------------------------------------------ kernel-table functions
class KernelProbe:
    """A kernel table whose functions can be watched: ``probe.kernels`` calls the wrapped
    table's functions and, while ``probe.capture`` is set, compares each call with the
    native fallback (:data:`NATIVE_KERNELS`) on the capture's reference, forward and backward
    (the backward by re-running both with autograd on the same inputs and output gradient).
    Build a model with ``probe.kernels`` to make its kernels checkable; with no capture set the
    wrapper only forwards the call."""

    def __init__(self, kernels: Kernels) -> None:
        self.base = kernels
        self.capture: PrecisionCapture | None = None
        wrapped = {slot: self._wrap(slot, fn) for slot, fn in kernels.functions().items()}
        self.kernels = replace(kernels, **wrapped)

    def _wrap(self, slot: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        label = f"kernel.{slot}[{self.base.names.get(slot, '?')}]"

        def call(*args: Any) -> torch.Tensor:
            capture = self.capture
            if capture is None or capture._paused:
                return fn(*args)
            record = capture.new_record(label, "kernel")
            out = fn(*args)
            autocast = _autocast_state(out.device.type)
            with capture.paused():
                self._compare_forward(capture, record, slot, args, out)
            if out.requires_grad:
                module = record.module
                out.register_hook(lambda grad: self._compare_backward(
                    capture, label, module, slot, fn, args, grad, autocast))
            return out

        return call

    @staticmethod
    def _compare_forward(capture: PrecisionCapture, record: OpRecord, slot: str,
                         args: tuple, out: torch.Tensor) -> None:
        ref_args = [capture.to_reference(a) for a in args]
        with torch.autocast(capture.reference.type, enabled=False):
            ref = NATIVE_KERNELS[slot](*ref_args)
        capture.fill(record, [out], [ref])

    def _compare_backward(self, capture: PrecisionCapture, label: str, module: str, slot: str,
                          fn: Callable[..., torch.Tensor], args: tuple, grad: torch.Tensor,
                          autocast: tuple[bool, torch.dtype]) -> None:
        if self.capture is not capture:  # a backward after the capture ended
            return
        record = capture.new_record(f"{label}.backward", "kernel")
        record.module, record.phase = module, "backward"
        with capture.paused():
            leaves = [a.detach().requires_grad_() if _differentiable(a) else a for a in args]
            wanted = [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
            with torch.enable_grad(), torch.autocast(grad.device.type, dtype=autocast[1],
                                                     enabled=autocast[0]):
                got = torch.autograd.grad(fn(*leaves), wanted, grad)
            ref_leaves = [capture.to_reference(a) for a in args]
            ref_leaves = [x.requires_grad_() if _differentiable(x) else x for x in ref_leaves]
            ref_wanted = [x for x in ref_leaves if isinstance(x, torch.Tensor)
                          and x.requires_grad]
            with torch.enable_grad(), torch.autocast(capture.reference.type, enabled=False):
                ref = torch.autograd.grad(NATIVE_KERNELS[slot](*ref_leaves), ref_wanted,
                                          capture.to_reference(grad))
            capture.fill(record, list(got), list(ref))


def _differentiable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    if not torch.is_autocast_enabled(device_type):
        return False, torch.float32
    return True, torch.get_autocast_dtype(device_type)


def check_kernels(kernels: Kernels, device: torch.device | str, dtype: torch.dtype,
                  reference: torch.device | str | None = None,
                  reference_dtype: torch.dtype | None = None, seed: int = 0) -> list[OpRecord]:
    """Every function of a kernel table against its native fallback, forward and backward, on
    seeded random inputs: ``rms_norm(x [4, 16, 64], weight [64], 1e-5)`` and
    ``swiglu(x [4, 16, 128])``. The native kernels run on ``reference`` in ``reference_dtype``
    (default: the same device and dtype: kernel against kernel). Two records per slot."""
    device = torch.device(device)
    capture = PrecisionCapture(reference or device, reference_dtype or dtype)
    probe = KernelProbe(kernels)
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) + shift).to(device, dtype).requires_grad_()

    inputs = {"rms_norm": (rand(4, 16, 64), rand(64, shift=1.0), 1e-5),
              "swiglu": (rand(4, 16, 128),)}
    probe.capture = capture
    try:
        for slot, fn in probe.kernels.functions().items():
            out = fn(*inputs[slot])
            out.backward(torch.randn(out.shape, generator=gen).to(device, out.dtype))
    finally:
        probe.capture = None
    return capture.records
