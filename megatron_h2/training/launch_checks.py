"""Start-up checks of the implementation flags (``--transformer-impl``, ``--attention-backend``,
``--fp8-*``): what the chosen kernels need, said in one line before any process group starts."""

from __future__ import annotations

from megatron_h2.config import ModelConfig
from megatron_h2.devices import Accelerator
from megatron_h2.devices.attention import check_attention_backend
from megatron_h2.devices.op_replay import DTYPES
from megatron_h2.errors import ConfigError, RankConfigError


def check_implementation(model: ModelConfig) -> None:
    """What every rank decides alike: FP8 and Transformer Engine."""
    if model.fp8_format is not None:
        raise ConfigError(
            f"--fp8-format {model.fp8_format} needs FP8 matrix multiplies from Transformer "
            "Engine's layers on an NVIDIA Hopper-or-newer GPU; megatron_h2 builds its own "
            "tensor-parallel layers and does not train in FP8: drop the --fp8-* flags (--bf16 "
            "is the closest precision)")
    if model.transformer_impl != "transformer_engine":
        return
    if model.attention_backend == "local":
        raise ConfigError("--attention-backend local is Megatron's own attention, not "
                          "Transformer Engine's; use --transformer-impl local with it")
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure means: not usable here
        raise ConfigError(
            "--transformer-impl transformer_engine needs NVIDIA Transformer Engine (pip install "
            "'transformer-engine[pytorch]', NVIDIA GPUs only), which does not import here "
            f"({type(exc).__name__}); use --transformer-impl local") from None


def check_attention_on_chip(model: ModelConfig, acc: Accelerator, params: str = "fp32") -> None:
    """What only this rank's chip can answer: can it run the chosen attention kernel for this
    model (``params``: the weights' and activations' dtype, ``Precision.params``; head size,
    grouped heads, dropout)?"""
    if model.transformer_impl == "transformer_engine":
        if acc.device_type != "cuda":
            raise RankConfigError(f"--transformer-impl transformer_engine runs on NVIDIA GPUs; "
                                  f"this rank's chip is {acc.registry_name()}: use "
                                  "--transformer-impl local")
        return
    dtype = DTYPES[params]
    why = check_attention_backend(model.attention_backend, acc.device, dtype,
                                  model.num_attention_heads, model.num_query_groups,
                                  model.kv_channels, model.attention_dropout)
    if why is not None:
        dtype_name = str(dtype).removeprefix("torch.")
        raise RankConfigError(
            f"--attention-backend {model.attention_backend} cannot run on "
            f"{acc.registry_name()} for this model ({dtype_name}, head size {model.kv_channels}, "
            f"{model.num_attention_heads} heads / {model.num_query_groups} key-value heads, "
            f"attention dropout {model.attention_dropout:g}): torch says \"{why}\"; use "
            "--attention-backend auto, or unfused")
