"""A second vendor for tests: "cpu2", an accelerator plug-in that runs on the CPU.

It is the worked example of docs/devices.md. It behaves as a chip of another vendor would:
its own name (plans say ``device: cpu2``), so a boundary between a cpu2 stage and a cpu stage
crosses the host-staged bridge; its own kernel table, written differently from the native
kernels (RMSNorm from rsqrt of the mean square, SwiGLU from sigmoid), so the conformance suite
and tools/precision_check.py have a real vendor kernel to hold against the native one; and its
own (emulated) memory statistics. Collectives use gloo.

Loaded like any plug-in: ``MEGATRON_H2_PLUGINS=tests.helpers.cpu2_plugin`` (every process of a
torchrun job inherits it), or an entry point in the ``megatron_h2.accelerators`` group.
"""

from __future__ import annotations

import torch

from megatron_h2.devices import Accelerator, Kernels, register_accelerator

CPU2_PLUGIN = __name__  # the module $MEGATRON_H2_PLUGINS names to load this plug-in


def cpu2_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm accumulated in fp32, output in the input dtype. x: [..., h], weight: [h]."""
    x32 = x.float()
    inv = torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + eps)  # [..., 1]
    return (x32 * inv * weight.float()).to(x.dtype)


def cpu2_swiglu(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [gate | up] projection. x: [..., 2f] -> [..., f]."""
    f = x.shape[-1] // 2
    gate, up = x[..., :f], x[..., f:]
    return gate * torch.sigmoid(gate) * up


class CPU2Accelerator(Accelerator):
    """The "cpu2" vendor: torch device ``cpu``, collectives over gloo, its own kernels."""

    name = "cpu2"
    device_type = "cpu"
    dist_backend = "gloo"
    auto_detect = False  # never picked by --device detection: a test vendor

    def __init__(self, index: int = 0) -> None:
        super().__init__(index)
        self._peak_bytes = 0

    @classmethod
    def is_available(cls) -> bool:
        return True

    def build_kernels(self) -> Kernels:
        return Kernels(rms_norm=cpu2_rms_norm, swiglu=cpu2_swiglu,
                       names={"rms_norm": "cpu2", "swiglu": "cpu2", "adamw": "foreach"})

    def memory_stats(self) -> dict[str, float]:
        """Resident set size of the process, as a vendor without an allocator API reports."""
        gib = 1024**3
        with open("/proc/self/statm") as fh:
            rss = int(fh.read().split()[1]) * _page_size()
        self._peak_bytes = max(self._peak_bytes, rss)
        return {"allocated_gib": rss / gib, "peak_gib": self._peak_bytes / gib}

    def reset_peak_memory(self) -> None:
        self._peak_bytes = 0


def _page_size() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE")


register_accelerator(CPU2Accelerator)
