"""Import paths of modules that moved, kept working: ``import megatron_h2.hetero_plan`` gives
:mod:`megatron_h2.plan.schema`, the same module object, so scripts written against the old
layout run unchanged. New code imports the new paths (``tests/unit/test_package_graph.py``
refuses old ones inside the package)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType

MOVED: dict[str, str] = {
    "megatron_h2.yaml_checks": "megatron_h2.plan.yaml_io",
    "megatron_h2.hetero_plan": "megatron_h2.plan.schema",
    "megatron_h2.pipeline_orders": "megatron_h2.plan.orders",
    "megatron_h2.planner.orders": "megatron_h2.planner.held_activations",
    "megatron_h2.planner.model": "megatron_h2.planner.model_input",
    "megatron_h2.config.model": "megatron_h2.config.model_config",
    "megatron_h2.config.precision": "megatron_h2.config.dtype_rules",
    "megatron_h2.devices.precision": "megatron_h2.devices.op_replay",
    "megatron_h2.devices.precision_report": "megatron_h2.devices.op_replay_report",
    "megatron_h2.models.gpt.model": "megatron_h2.models.gpt.gpt_model",
    "megatron_h2.checkpointing.distributed": "megatron_h2.checkpointing.checkpoint_io",
    "megatron_h2.pipeline.schedules": "megatron_h2.pipeline.schedule_runner",
    "megatron_h2.training.megatron_compat": "megatron_h2.config.megatron_flags",
    "megatron_h2.training.metrics": "megatron_h2.monitoring.metrics",
    "megatron_h2.training.timers": "megatron_h2.monitoring.timers",
    "megatron_h2.training.timeline": "megatron_h2.monitoring.timeline",
    "megatron_h2.training.stage_clock": "megatron_h2.monitoring.stage_clock",
    "megatron_h2.training.profiler": "megatron_h2.monitoring.torch_profiler",
    "megatron_h2.training.health": "megatron_h2.monitoring.health",
    "megatron_h2.training.precision": "megatron_h2.monitoring.precision_monitor",
    "megatron_h2.training.watchdog": "megatron_h2.monitoring.watchdog",
    "megatron_h2.training.kernel_checks": "megatron_h2.training.launch_checks",
    "megatron_h2.training.elastic": "megatron_h2.elastic.launcher",
    "megatron_h2.training.replan": "megatron_h2.elastic.replan",
    "megatron_h2.training.profile_chip": "megatron_h2.measurement.chip_timing",
    "megatron_h2.training.host_load": "megatron_h2.measurement.host_load",
    "megatron_h2.training.trainer": "megatron_h2.training.loop",
}
"""Old dotted module path -> where the module lives now."""


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path (after every real module: it never shadows one) and loads it as the
    module at its new path."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """The module at the new path is already executed."""


def install() -> None:
    """Make the old paths importable (idempotent; called when megatron_h2 is imported)."""
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.append(_Alias())
