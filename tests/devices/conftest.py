"""The conformance suite runs once per available accelerator: cpu always, the test-only second
vendor "cpu2" (tests/devices/cpu2_plugin.py, loaded as any plug-in is), cuda / npu / mlu / xpu
where their torch plug-in imports and a device is present, and any vendor plug-in installed as
an entry point or named by $MEGATRON_H2_PLUGINS."""

from __future__ import annotations

import pytest

from megatron_h2.devices import ACCELERATORS, PLUGINS_ENV, load_plugins

CPU2_PLUGIN = "tests.helpers.cpu2_plugin"
load_plugins()  # a vendor's own plug-in (entry point or $MEGATRON_H2_PLUGINS) joins the suite
load_plugins({PLUGINS_ENV: CPU2_PLUGIN})  # registers "cpu2" for this test session
AVAILABLE = [name for name, cls in ACCELERATORS.items() if cls.is_available()]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "acc_name" in metafunc.fixturenames:
        metafunc.parametrize("acc_name", AVAILABLE)
