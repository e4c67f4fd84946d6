"""--attention-backend / --use-flash-attn select torch's SDPA kernels, --transformer-impl
transformer_engine uses Transformer Engine where it imports, and the FP8 flags say what they
need; what a chip cannot run is one line at start-up."""

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from megatron_h2.devices import get_accelerator
from megatron_h2.devices.attention import SDPA_BACKENDS, TE_BACKEND_ENV
from megatron_h2.errors import ConfigError, RankConfigError
from megatron_h2.training.arguments import config_from_args, describe_no_effect
from megatron_h2.training.launch_checks import check_attention_on_chip, check_implementation
from megatron_h2.training.main import main
from tests.helpers.tiny_models import build, tiny

CPU = get_accelerator("cpu")
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "1",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
        "--eval-iters", "0", "--attention-dropout", "0"]


def attention_ops(model, tokens) -> set[str]:
    """The aten SDPA kernels a forward and backward of ``model`` ran."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(tokens=tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    return {e.name for e in prof.events() if "scaled_dot_product" in e.name
            and ("flash" in e.name or "math" in e.name or "efficient" in e.name)}


@pytest.mark.parametrize("backend, kernel", [("unfused", "math"), ("local", "math"),
                                             ("flash", "flash")])
def test_backend_selects_the_kernel_and_agrees_with_auto(backend, kernel):
    tokens = torch.randint(0, 128, (2, 17))
    reference = build(tiny())
    model = build(tiny(attention_backend=backend))
    used = attention_ops(model, tokens)
    assert used and all(kernel in name for name in used), used
    other = "flash" if kernel == "math" else "math"
    assert not any(other in name for name in attention_ops(model, tokens))
    torch.testing.assert_close(model(tokens=tokens[:, :-1]), reference(tokens=tokens[:, :-1]),
                               rtol=1e-5, atol=1e-5)


def test_use_flash_attn_is_flash_and_conflicts_are_errors():
    cfg, _ = config_from_args(BASE + ["--use-flash-attn"])
    assert cfg.model.attention_backend == "flash"
    with pytest.raises(ConfigError, match="--use-flash-attn asks for flash attention"):
        config_from_args(BASE + ["--use-flash-attn", "--attention-backend", "unfused"])
    assert config_from_args(BASE)[0].model.attention_backend == "auto"  # Megatron's default
    assert set(SDPA_BACKENDS) == {"flash", "fused", "unfused", "local", "auto"}


def test_a_backend_the_chip_cannot_run_is_one_line_naming_why():
    flash_dropout = tiny(attention_backend="flash", attention_dropout=0.1)
    with pytest.raises(RankConfigError, match=r"--attention-backend flash cannot run on cpu .*"
                       r"attention dropout 0.1\): torch says"):
        check_attention_on_chip(flash_dropout, CPU)
    with pytest.raises(RankConfigError, match="--attention-backend fused cannot run on cpu"):
        check_attention_on_chip(tiny(attention_backend="fused"), CPU)
    for backend in ("flash", "unfused", "local", "auto"):  # these run here without dropout
        check_attention_on_chip(tiny(attention_backend=backend), CPU, "bf16")


def test_start_up_error_before_training(capsys):
    assert main(BASE + ["--attention-backend", "fused"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --attention-backend fused cannot run")


def test_transformer_engine_missing_is_one_line(capsys):
    assert main(BASE + ["--transformer-impl", "transformer_engine"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs NVIDIA Transformer Engine" in err[0]
    assert "use --transformer-impl local" in err[0]


def test_fp8_flags_say_what_they_need(capsys):
    assert main(BASE + ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Hopper" in err[0] and "drop the --fp8-* flags" in err[0]
    _, launch = config_from_args(BASE + ["--fp8-amax-history-len", "1024",
                                         "--fp8-amax-compute-algo", "max", "--fp8-param-gather"])
    line = describe_no_effect(launch)
    for flag in ("--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-param-gather"):
        assert f"{flag} (needs --fp8-format)" in line


@pytest.fixture
def fake_transformer_engine(monkeypatch):
    """A stand-in ``transformer_engine.pytorch`` whose DotProductAttention records how it was
    built and called and computes causal attention on [b, s, h, d] tensors."""
    built, calls = [], []

    class DotProductAttention(torch.nn.Module):
        def __init__(self, heads, head_dim, **kwargs):
            super().__init__()
            built.append((heads, head_dim, kwargs))

        def forward(self, q, k, v):
            calls.append((q.shape, k.shape))
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                 v.transpose(1, 2), is_causal=True,
                                                 enable_gqa=True)
            return out.transpose(1, 2).flatten(2)

    te = types.ModuleType("transformer_engine")
    te.pytorch = types.SimpleNamespace(DotProductAttention=DotProductAttention)
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te.pytorch)
    for name in TE_BACKEND_ENV["flash"]:
        monkeypatch.delenv(name, raising=False)
    return built, calls


def test_transformer_engine_attention_where_it_imports(fake_transformer_engine, monkeypatch):
    built, calls = fake_transformer_engine
    cfg = tiny(transformer_impl="transformer_engine", attention_backend="flash")
    check_implementation(cfg)  # imports: no error
    tokens = torch.randint(0, 128, (2, 17))
    model = build(cfg)
    assert built == [(4, 16, {"num_gqa_groups": 2, "attention_dropout": 0.0,
                              "qkv_format": "bshd", "attn_mask_type": "causal"})] * 4
    assert {k: __import__("os").environ[k] for k in TE_BACKEND_ENV["flash"]} \
        == TE_BACKEND_ENV["flash"]
    torch.testing.assert_close(model(tokens=tokens[:, :-1]), build(tiny())(tokens=tokens[:, :-1]),
                               rtol=1e-5, atol=1e-5)
    assert calls[0] == (torch.Size([2, 16, 4, 16]), torch.Size([2, 16, 2, 16]))
    with pytest.raises(RankConfigError, match="runs on NVIDIA GPUs"):
        check_attention_on_chip(cfg, CPU)
    with pytest.raises(ConfigError, match="--attention-backend local is Megatron's own"):
        check_implementation(tiny(transformer_impl="transformer_engine",
                                  attention_backend="local"))
