"""A small registry of compute kernels with native torch fallbacks.

Each accelerator builds one :class:`Kernels` at start-up. Vendor-fused kernels (for example
NVIDIA apex's fused RMSNorm) are used only where they import; otherwise the native torch
implementation runs. Nothing is probed at import time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

RMSNormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
LayerNormFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32 accumulation, output in the input dtype. x: [..., h], weight: [h]."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def native_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                      eps: float) -> torch.Tensor:
    """LayerNorm with scale and bias. x: [..., h], weight and bias: [h]."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def native_swiglu(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [gate | up] projection. x: [..., 2f] -> [..., f]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


NATIVE_KERNELS: dict[str, Callable[..., torch.Tensor]] = {"rms_norm": native_rms_norm,
                                                          "swiglu": native_swiglu}
"""The native torch fallback of every kernel slot of :class:`Kernels` (the reference that
vendor kernels are checked against: tests/unit/devices/test_conformance.py,
tools/precision_check.py)."""


@dataclass(frozen=True)
class Kernels:
    """The kernels the model and optimizer call, chosen once per accelerator.

    ``rms_norm(x, weight, eps)`` and ``swiglu(x)`` must compute what their native fallbacks in
    :data:`NATIVE_KERNELS` compute, forward and backward (autograd), within the tolerance of the
    input dtype; ``names`` says which implementation fills each slot (for logs).
    """

    rms_norm: RMSNormFn = native_rms_norm
    layer_norm: LayerNormFn = native_layer_norm
    swiglu: Callable[[torch.Tensor], torch.Tensor] = native_swiglu
    fused_adamw: bool = False  # torch.optim.AdamW(fused=True) supported on this device
    names: dict[str, str] = field(default_factory=lambda: {"rms_norm": "native",
                                                            "layer_norm": "native",
                                                            "swiglu": "native",
                                                            "adamw": "foreach"})

    def functions(self) -> dict[str, Callable[..., torch.Tensor]]:
        """``{slot: this table's function}`` for every slot of :data:`NATIVE_KERNELS`."""
        return {name: getattr(self, name) for name in NATIVE_KERNELS}


def _apex_rms_norm() -> RMSNormFn | None:
    """apex's fused RMSNorm, if apex (NVIDIA's, with CUDA extensions) is importable."""
    try:
        from apex.normalization.fused_layer_norm import fused_rms_norm_affine  # type: ignore
    except Exception:  # noqa: BLE001 - any failure means: not usable here
        return None

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return fused_rms_norm_affine(x, weight, weight.shape, eps)

    return rms_norm


def build_kernels(device_type: str) -> Kernels:
    """Pick the best available kernels for ``device_type`` (``cpu``, ``cuda``, ...)."""
    if device_type == "cuda":
        apex_norm = _apex_rms_norm()
        names = {"rms_norm": "apex" if apex_norm else "native", "layer_norm": "native",
                 "swiglu": "native",
                 "adamw": "fused"}
        return Kernels(rms_norm=apex_norm or native_rms_norm, fused_adamw=True, names=names)
    return Kernels()
