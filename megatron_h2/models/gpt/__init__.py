"""LLaMA-style GPT model."""

from megatron_h2.models.gpt.model import GPTModel, init_parameters

__all__ = ["GPTModel", "init_parameters"]
