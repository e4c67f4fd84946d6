"""The GPT model, built per pipeline stage with layers keyed by global index
(:mod:`megatron_h2.models.gpt`)."""

from megatron_h2.models.gpt import GPTModel, cast_parameters, init_parameters

__all__ = ["GPTModel", "cast_parameters", "init_parameters"]
