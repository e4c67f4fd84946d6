"""DiTorch-style device layer: one interface over each vendor's torch backend."""

from megatron_h2.devices.accelerator import (
    ACCELERATORS,
    Accelerator,
    CPUAccelerator,
    CUDAAccelerator,
    detect_device_type,
    fork_rng,
    get_accelerator,
)
from megatron_h2.devices.kernels import Kernels, build_kernels, native_rms_norm, native_swiglu

__all__ = ["ACCELERATORS", "Accelerator", "CPUAccelerator", "CUDAAccelerator", "Kernels",
           "build_kernels", "detect_device_type", "fork_rng", "get_accelerator",
           "native_rms_norm", "native_swiglu"]
