"""Vendor plug-ins: accelerators that live outside megatron_h2, loaded at start-up.

A plug-in is a Python module that subclasses :class:`~megatron_h2.devices.Accelerator` and
calls :func:`~megatron_h2.devices.register_accelerator` when it is imported. Two ways to make
every process of a job import it (``pretrain_gpt.py`` and the tools call :func:`load_plugins`
first thing, so torchrun and SLURM workers pick them up too):

* an installed package declares an entry point in the group ``megatron_h2.accelerators``::

      [project.entry-points."megatron_h2.accelerators"]
      acme = "acme_megatron.accelerator"          # a module (registers on import)
      # or: acme = "acme_megatron.accelerator:AcmeAccelerator"   (a class: registered here)

* the environment variable ``MEGATRON_H2_PLUGINS`` lists modules to import, comma-separated
  (``MEGATRON_H2_PLUGINS=acme_megatron.accelerator``); it is inherited by every worker torchrun
  or srun starts.

Nothing is imported before :func:`load_plugins` runs, and a plug-in that fails to import is a
one-line :class:`~megatron_h2.errors.ConfigError` (never a silent fallback to another device).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from importlib.metadata import entry_points

from megatron_h2.devices.accelerator import PLUGINS_ENV, Accelerator, register_accelerator
from megatron_h2.errors import ConfigError

ENTRY_POINT_GROUP = "megatron_h2.accelerators"


def _register(obj: object, where: str) -> None:
    if isinstance(obj, type) and issubclass(obj, Accelerator):
        register_accelerator(obj)
    elif not hasattr(obj, "__file__") and not hasattr(obj, "__path__"):  # not a module
        raise ConfigError(f"accelerator plug-in {where} is neither a module nor an Accelerator "
                          f"subclass: {obj!r}")


def load_plugins(environ: Mapping[str, str] | None = None) -> list[str]:
    """Import every plug-in named by entry points and ``$MEGATRON_H2_PLUGINS``; return what was
    loaded (entry point names and module names). Safe to call more than once."""
    environ = os.environ if environ is None else environ
    loaded = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
        except Exception as exc:  # noqa: BLE001 - report any import failure as one line
            raise ConfigError(f"accelerator plug-in {ep.name!r} ({ep.value}) failed to load: "
                              f"{type(exc).__name__}: {exc}") from None
        _register(obj, f"{ep.name!r} ({ep.value})")
        loaded.append(ep.name)
    for module in filter(None, (m.strip() for m in environ.get(PLUGINS_ENV, "").split(","))):
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - report any import failure as one line
            raise ConfigError(f"${PLUGINS_ENV} names module {module!r}, which failed to import: "
                              f"{type(exc).__name__}: {exc}") from None
        loaded.append(module)
    return loaded
