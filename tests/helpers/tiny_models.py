"""Tiny models built in the test process: a LLaMA-style config and its initialised GPTModel."""

from megatron_h2.config import LLAMA_ARCHITECTURE, ModelConfig
from megatron_h2.models.gpt import GPTModel, init_parameters


def tiny(**kw) -> ModelConfig:
    """A 4-layer LLaMA-style model config; ``kw`` overrides its fields."""
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=96, seq_length=16, vocab_size=128, hidden_dropout=0.0,
                attention_dropout=0.0, group_query_attention=True, **LLAMA_ARCHITECTURE)
    base.update(kw)
    return ModelConfig(**base)


def build(cfg, seed=3, **kw):
    """``GPTModel(cfg, **kw)`` with parameters initialised from ``seed``."""
    model = GPTModel(cfg, **kw)
    init_parameters(model, cfg, seed)
    return model
