"""DiTorch-style device layer: one interface over each vendor's torch backend."""

from megatron_h2.devices.accelerator import (
    ACCELERATORS,
    PLUGINS_ENV,
    Accelerator,
    CPUAccelerator,
    CUDAAccelerator,
    detect_device_type,
    fork_rng,
    get_accelerator,
    register_accelerator,
    unregister_accelerator,
)
from megatron_h2.devices.kernels import (
    NATIVE_KERNELS,
    Kernels,
    build_kernels,
    native_rms_norm,
    native_swiglu,
)
from megatron_h2.devices.plugins import load_plugins

__all__ = ["ACCELERATORS", "NATIVE_KERNELS", "PLUGINS_ENV", "Accelerator", "CPUAccelerator",
           "CUDAAccelerator", "Kernels", "build_kernels", "detect_device_type", "fork_rng",
           "get_accelerator", "load_plugins", "native_rms_norm", "native_swiglu",
           "register_accelerator", "unregister_accelerator"]
