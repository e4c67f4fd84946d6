"""LLaMA-style GPT model."""

from megatron_h2.models.gpt.model import GPTModel, flops_per_token, init_parameters, num_parameters

__all__ = ["GPTModel", "flops_per_token", "init_parameters", "num_parameters"]
