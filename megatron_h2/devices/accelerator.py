"""Device-independent interface over each vendor's torch backend.

An :class:`Accelerator` answers the questions the rest of megatron_h2 asks of a chip: which torch
device type and collective backend it uses, how to synchronise, its memory statistics, its RNG
state, its autocast dtype and its kernels. ``cpu`` and ``cuda`` are implemented, ``npu``, ``mlu``
and ``xpu`` drive their vendors' torch plug-ins; other vendors plug in by subclassing
:class:`Accelerator` and calling :func:`register_accelerator` (from a plug-in module that
:func:`~megatron_h2.devices.plugins.load_plugins` imports at start-up; docs/devices.md walks
through one).

The accelerator is chosen by :func:`get_accelerator` at start-up (``--device`` or detection),
never at import time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import MappingProxyType

import torch

from megatron_h2.devices.kernels import Kernels, build_kernels
from megatron_h2.errors import ConfigError

PLUGINS_ENV = "MEGATRON_H2_PLUGINS"


class Accelerator:
    """Base class; subclasses set ``device_type`` and ``dist_backend``.

    ``name`` is what plans (``chips: {x: {device: NAME}}``) and ``--device`` call it (default:
    ``device_type``); two accelerators may share a torch device type under different names
    (a vendor plug-in that runs on the CPU, for instance). ``auto_detect`` says whether
    :func:`detect_device_type` may pick it when no device is given.
    """

    name: str = ""
    device_type: str = ""
    dist_backend: str = ""
    auto_detect: bool = True

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self.kernels: Kernels = self.build_kernels()

    @classmethod
    def registry_name(cls) -> str:
        return cls.name or cls.device_type

    def build_kernels(self) -> Kernels:
        """This accelerator's kernel table (vendor kernels where they import, else native);
        a plug-in overrides it to install its own kernels."""
        return build_kernels(self.device_type)

    @classmethod
    def is_available(cls) -> bool:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    def synchronize(self) -> None:
        """Wait for all queued work on this device."""

    def memory_stats(self) -> dict[str, float]:
        """Allocated / reserved / peak memory in GiB (empty where the backend has none)."""
        return {}

    def reset_peak_memory(self) -> None:
        """Start a new peak-memory window."""

    def get_rng_state(self) -> torch.Tensor | None:
        """Device RNG state (None where the device shares the CPU generator)."""
        return None

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        """Restore a state returned by :meth:`get_rng_state`."""

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    @property
    def autocast_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def autocast(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Mixed-precision context for forward passes (no-op when disabled)."""
        if not enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def describe(self) -> str:
        name = self.registry_name()
        kind = name if name == self.device_type else f"{name} (torch device {self.device_type})"
        return f"{kind} (collectives: {self.dist_backend}, kernels: {self.kernels.names})"


class CPUAccelerator(Accelerator):
    device_type = "cpu"
    dist_backend = "gloo"

    @classmethod
    def is_available(cls) -> bool:
        return True


class CUDAAccelerator(Accelerator):
    device_type = "cuda"
    dist_backend = "nccl"

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.index)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def memory_stats(self) -> dict[str, float]:
        gib = 1024**3
        return {"allocated_gib": torch.cuda.memory_allocated(self.device) / gib,
                "reserved_gib": torch.cuda.memory_reserved(self.device) / gib,
                "peak_gib": torch.cuda.max_memory_allocated(self.device) / gib}

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def get_rng_state(self) -> torch.Tensor | None:
        return torch.cuda.get_rng_state(self.device)

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        if state is not None:
            torch.cuda.set_rng_state(state, self.device)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.cuda.manual_seed(seed)


class _TorchBackendAccelerator(Accelerator):
    """A vendor whose torch plug-in exposes ``torch.<device_type>`` with CUDA-like calls
    (``is_available``, ``synchronize``, ``memory_allocated``, ``get_rng_state``, ...)."""

    plugin_module: str = ""  # imported first to register the device with torch, if needed

    @classmethod
    def _module(cls):
        if cls.plugin_module:
            try:
                __import__(cls.plugin_module)
            except Exception:  # noqa: BLE001 - plug-in missing or broken: not available
                return None
        return getattr(torch, cls.device_type, None)

    @classmethod
    def is_available(cls) -> bool:
        mod = cls._module()
        return bool(mod is not None and mod.is_available())

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type, self.index)

    def synchronize(self) -> None:
        self._module().synchronize(self.device)

    def memory_stats(self) -> dict[str, float]:
        mod, gib = self._module(), 1024**3
        return {"allocated_gib": mod.memory_allocated(self.device) / gib,
                "peak_gib": mod.max_memory_allocated(self.device) / gib}

    def get_rng_state(self) -> torch.Tensor | None:
        return self._module().get_rng_state(self.device)

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        if state is not None:
            self._module().set_rng_state(state, self.device)


class NPUAccelerator(_TorchBackendAccelerator):
    """Huawei Ascend through the ``torch_npu`` plug-in (collectives: HCCL)."""

    device_type, dist_backend, plugin_module = "npu", "hccl", "torch_npu"


class MLUAccelerator(_TorchBackendAccelerator):
    """Cambricon MLU through the ``torch_mlu`` plug-in (collectives: CNCL)."""

    device_type, dist_backend, plugin_module = "mlu", "cncl", "torch_mlu"


class XPUAccelerator(_TorchBackendAccelerator):
    """Intel GPUs through torch's built-in ``xpu`` device (collectives: XCCL)."""

    device_type, dist_backend = "xpu", "xccl"


_REGISTRY: dict[str, type[Accelerator]] = {
    "cpu": CPUAccelerator, "cuda": CUDAAccelerator, "npu": NPUAccelerator,
    "mlu": MLUAccelerator, "xpu": XPUAccelerator}

ACCELERATORS: MappingProxyType[str, type[Accelerator]] = MappingProxyType(_REGISTRY)
"""Every known accelerator by name (read-only view; add to it with
:func:`register_accelerator`)."""


def register_accelerator(cls: type[Accelerator], *, replace: bool = False) -> type[Accelerator]:
    """Make ``cls`` known under ``cls.name`` (or its ``device_type``); returns ``cls``, so it
    works as a class decorator. Registering the same class again is a no-op; taking a name that
    another class holds needs ``replace=True``."""
    if not (isinstance(cls, type) and issubclass(cls, Accelerator)):
        raise ConfigError(f"register_accelerator needs an Accelerator subclass, got {cls!r}")
    name = cls.registry_name()
    if not name or not name.isidentifier():
        raise ConfigError(f"accelerator {cls.__name__} needs a name (letters, digits, _), "
                          f"got {name!r}")
    if not cls.device_type or not cls.dist_backend:
        raise ConfigError(f"accelerator {name!r} ({cls.__name__}) must set device_type and "
                          "dist_backend")
    held = _REGISTRY.get(name)
    if held is not None and held is not cls and not replace:
        raise ConfigError(f"accelerator name {name!r} is taken by {held.__module__}."
                          f"{held.__qualname__}; pick another name")
    _REGISTRY[name] = cls
    return cls


def unregister_accelerator(name: str) -> None:
    """Forget a plug-in accelerator (built-in ones stay)."""
    if name in ("cpu", "cuda", "npu", "mlu", "xpu"):
        raise ConfigError(f"built-in accelerator {name!r} cannot be unregistered")
    _REGISTRY.pop(name, None)


def detect_device_type() -> str:
    """The first available accelerator, preferring real accelerators over the CPU."""
    for name, cls in ACCELERATORS.items():
        if name != "cpu" and cls.auto_detect and cls.is_available():
            return name
    return "cpu"


def get_accelerator(device_type: str | None = None, index: int = 0) -> Accelerator:
    """Build the accelerator for ``device_type`` (detected when None).

    Raises ConfigError for an unknown or unavailable device type; never falls back silently.
    """
    name = device_type or detect_device_type()
    cls = ACCELERATORS.get(name)
    if cls is None:
        raise ConfigError(f"unknown --device {name!r}; supported: {', '.join(ACCELERATORS)} "
                          f"(vendor plug-ins load from ${PLUGINS_ENV}, see docs/devices.md)")
    if not cls.is_available():
        raise ConfigError(f"--device {name} is not available on this machine "
                          f"(torch {torch.__version__}); pick another device or install its "
                          "torch backend")
    return cls(index)


@contextlib.contextmanager
def fork_rng(accelerator: Accelerator) -> Iterator[None]:
    """Run a block without disturbing the CPU and device RNG streams."""
    cpu_state = torch.get_rng_state()
    dev_state = accelerator.get_rng_state()
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        accelerator.set_rng_state(dev_state)
