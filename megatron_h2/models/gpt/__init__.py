"""LLaMA-style GPT model."""

from megatron_h2.models.gpt.gpt_model import GPTModel, cast_parameters, init_parameters

__all__ = ["GPTModel", "cast_parameters", "init_parameters"]
