"""Planner test models, given positionally as the tests read best:
(num_layers, hidden_size, ffn_hidden_size, num_attention_heads, seq_length, vocab_size, groups).
They are LLaMA-style (the architecture keys of examples/models/*.yaml)."""

from megatron_h2.config import ModelConfig
from megatron_h2.planner.model_input import model_from_dict

LLAMA_KEYS = {"swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope",
              "disable_bias_linear": True, "untie_embeddings_and_output_weights": True}


def planner_model(num_layers: int, hidden_size: int, ffn_hidden_size: int,
                  num_attention_heads: int, seq_length: int, vocab_size: int,
                  num_query_groups: int | None = None,
                  max_position_embeddings: int | None = None) -> ModelConfig:
    """The model the planner builds from these flags (vocabulary padded as the runtime pads)."""
    data = {"num_layers": num_layers, "hidden_size": hidden_size,
            "ffn_hidden_size": ffn_hidden_size, "num_attention_heads": num_attention_heads,
            "seq_length": seq_length, "vocab_size": vocab_size, **LLAMA_KEYS}
    if num_query_groups is not None:
        data["num_query_groups"] = num_query_groups
        data["group_query_attention"] = True
    if max_position_embeddings is not None:
        data["max_position_embeddings"] = max_position_embeddings
    return model_from_dict(data)
