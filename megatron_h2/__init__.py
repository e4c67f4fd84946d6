"""megatron_h2: Megatron-style LLM pretraining across heterogeneous accelerator clusters."""

__version__ = "0.1.0"
