"""Shared fixtures: a tiny learnable corpus in Megatron's format, made by the real tool, and the
single-process reference of the tiny model; and the accelerators the conformance suite runs on.

Tests taking ``acc_name`` run once per available accelerator: cpu always, the test-only second
vendor "cpu2" (tests/helpers/cpu2_plugin.py, loaded as any plug-in is), cuda / npu / mlu / xpu
where their torch plug-in imports and a device is present, and any vendor plug-in installed as
an entry point or named by $MEGATRON_H2_PLUGINS."""

from __future__ import annotations

import os

import pytest
import torch

pytest.register_assert_rewrite("tests.helpers")  # helpers' asserts explain failures as tests' do

from megatron_h2.devices import ACCELERATORS, PLUGINS_ENV, load_plugins  # noqa: E402
from tests.helpers.cpu2_plugin import CPU2_PLUGIN  # noqa: E402
from tests.helpers.dist_utils import write_counting_corpus  # noqa: E402
from tests.helpers.tiny_runs import VOCAB  # noqa: E402

load_plugins()  # a vendor's own plug-in (entry point or $MEGATRON_H2_PLUGINS) joins the suite
load_plugins({PLUGINS_ENV: CPU2_PLUGIN})  # registers "cpu2" for this test session
AVAILABLE = [name for name, cls in ACCELERATORS.items() if cls.is_available()]


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``-n N``) each worker is one core's worth: torch in the worker and in
    every process its tests start runs one thread, so that N workers do not spin 2N OpenMP
    threads on N cores."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "acc_name" in metafunc.fixturenames:
        metafunc.parametrize("acc_name", AVAILABLE)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    """Counting sequences (each token is the previous plus one), so a tiny model learns fast."""
    return write_counting_corpus(tmp_path_factory.mktemp("corpus"), 300, (40, 120), VOCAB)


@pytest.fixture(scope="session")
def tiny_reference(corpus, tmp_path_factory) -> dict[int, float]:
    """``{iteration: loss}`` of one process training ``dist_utils.tiny_model_flags()`` with
    micro-batch 2 and global batch 8: what multi-process runs of that model must reproduce."""
    from megatron_h2.training.main import main
    from tests.helpers.dist_utils import losses, tiny_model_flags

    log = tmp_path_factory.mktemp("tiny_reference") / "log.jsonl"
    assert main([*tiny_model_flags(), "--data-path", corpus, "--micro-batch-size", "2",
                 "--global-batch-size", "8", "--log-jsonl", str(log)]) == 0
    return losses(log)
