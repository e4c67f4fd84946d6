"""The device layer: selection at start-up, kernels with native fallbacks, RNG."""

import pytest
import torch

from megatron_h2.devices import (
    ACCELERATORS,
    build_kernels,
    detect_device_type,
    fork_rng,
    get_accelerator,
    native_rms_norm,
)
from megatron_h2.errors import ConfigError


def test_cpu_accelerator_interface():
    acc = get_accelerator("cpu")
    assert acc.device == torch.device("cpu") and acc.dist_backend == "gloo"
    acc.synchronize()
    assert acc.memory_stats() == {}
    assert acc.autocast_dtype == torch.bfloat16
    with acc.autocast(True):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with acc.autocast(False):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    assert "cpu" in acc.describe()


def test_detection_and_errors():
    assert detect_device_type() in ACCELERATORS
    if not torch.cuda.is_available():
        assert detect_device_type() == "cpu"
        with pytest.raises(ConfigError, match="not available on this machine"):
            get_accelerator("cuda")
    with pytest.raises(ConfigError, match="unknown --device 'tpu9'"):
        get_accelerator("tpu9")


def test_kernels_fall_back_to_native_and_are_correct():
    k = build_kernels("cpu")
    assert k.rms_norm is native_rms_norm and not k.fused_adamw
    x, w = torch.randn(3, 8), torch.randn(8)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(k.rms_norm(x, w, 1e-5), ref)
    y = torch.randn(2, 6)
    torch.testing.assert_close(k.swiglu(y), torch.nn.functional.silu(y[:, :3]) * y[:, 3:])


def test_fork_rng_leaves_streams_untouched():
    acc = get_accelerator("cpu")
    acc.manual_seed(5)
    expected = torch.rand(3)
    acc.manual_seed(5)
    with fork_rng(acc):
        torch.rand(10)
    torch.testing.assert_close(torch.rand(3), expected)
