"""Vendor plug-ins: the registration API, loading from entry points and $MEGATRON_H2_PLUGINS,
and one-line errors. (A job with a stage on the plug-in: tests/e2e/test_device_plugins.py.)"""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest
import torch.distributed as dist
import yaml

from megatron_h2.devices import (
    ACCELERATORS,
    PLUGINS_ENV,
    CPUAccelerator,
    get_accelerator,
    load_plugins,
    register_accelerator,
    unregister_accelerator,
)
from megatron_h2.devices import plugins as plugins_module
from megatron_h2.errors import ConfigError
from megatron_h2.training.main import main
from tests.helpers.cpu2_plugin import CPU2_PLUGIN, CPU2Accelerator
from tests.helpers.dist_utils import tiny_model_flags

MODEL = tiny_model_flags()


class Elsewhere(CPUAccelerator):
    name = "elsewhere"


def test_registration_api():
    assert ACCELERATORS["cpu2"] is CPU2Accelerator
    assert register_accelerator(CPU2Accelerator) is CPU2Accelerator  # again: a no-op
    with pytest.raises(ConfigError, match="needs an Accelerator subclass"):
        register_accelerator(object)
    with pytest.raises(ConfigError, match="'cpu2' is taken by tests.helpers.cpu2_plugin"):
        register_accelerator(type("Other", (CPUAccelerator,), {"name": "cpu2"}))
    with pytest.raises(ConfigError, match="needs a name"):
        register_accelerator(type("Bad", (CPUAccelerator,), {"name": "no-dash"}))
    with pytest.raises(ConfigError, match="must set device_type and dist_backend"):
        register_accelerator(type("Bare", (CPUAccelerator,), {"name": "bare",
                                                              "dist_backend": ""}))
    with pytest.raises(ConfigError, match="cannot be unregistered"):
        unregister_accelerator("cpu")
    register_accelerator(Elsewhere)
    try:
        acc = get_accelerator("elsewhere")
        assert acc.device_type == "cpu" and acc.describe().startswith("elsewhere (torch device")
    finally:
        unregister_accelerator("elsewhere")
    assert "elsewhere" not in ACCELERATORS


def test_entry_points_register_classes(monkeypatch):
    point = EntryPoint(name="elsewhere", value=f"{__name__}:Elsewhere",
                       group=plugins_module.ENTRY_POINT_GROUP)
    monkeypatch.setattr(plugins_module, "entry_points", lambda group: [point])
    try:
        assert load_plugins({}) == ["elsewhere"]
        assert ACCELERATORS["elsewhere"] is Elsewhere
    finally:
        unregister_accelerator("elsewhere")
    broken = EntryPoint(name="broken", value="no_such_vendor.accel:Thing",
                        group=plugins_module.ENTRY_POINT_GROUP)
    monkeypatch.setattr(plugins_module, "entry_points", lambda group: [broken])
    with pytest.raises(ConfigError, match="plug-in 'broken' .* failed to load: "
                                          "ModuleNotFoundError"):
        load_plugins({})


def test_env_var_loads_modules():
    assert load_plugins({PLUGINS_ENV: f" {CPU2_PLUGIN} ,"}) == [CPU2_PLUGIN]


@pytest.fixture
def without_cpu2():
    unregister_accelerator("cpu2")
    yield
    register_accelerator(CPU2Accelerator)


def _plan(path, chips) -> str:
    path.write_text(yaml.safe_dump({
        "data_parallel_size": 1, "micro_batch_size": 2, "global_batch_size": 8,
        "chips": chips,
        "stages": [{"chip": "vendor2", "tensor_parallel_size": 1, "num_layers": 2},
                   {"chip": "host", "tensor_parallel_size": 1, "num_layers": 2}]}))
    return str(path)


CHIPS = {"vendor2": {"device": "cpu2"}, "host": {"device": "cpu"}}


def test_plugin_errors_are_one_line(corpus, tmp_path, monkeypatch, capsys, without_cpu2):
    plan = _plan(tmp_path / "plan.yaml", CHIPS)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv(PLUGINS_ENV, raising=False)
    assert main([*MODEL, "--data-path", corpus, "--hetero-plan", plan]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: chip 'vendor2' has unknown device 'cpu2'") and "\n" not in err
    assert f"${PLUGINS_ENV}" in err
    monkeypatch.setenv(PLUGINS_ENV, "no_such_vendor_plugin")
    assert main([*MODEL, "--data-path", corpus, "--hetero-plan", plan]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: ${PLUGINS_ENV} names module 'no_such_vendor_plugin', which failed "
                   "to import: ModuleNotFoundError: No module named 'no_such_vendor_plugin'")
    assert not dist.is_initialized()
