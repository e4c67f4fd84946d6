"""The one description of the model: :class:`ModelConfig` (its counts come from
:class:`~megatron_h2.config.model_counts.ModelCounts`) and vocabulary padding, shared by the
runtime and the planner (the bytes of model state per parameter are in :mod:`.precision`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from megatron_h2.config.flags import _positive, flag
from megatron_h2.config.model_counts import RECOMPUTE_MODES, ModelCounts, Recompute
from megatron_h2.config.moe_config import MoEFields
from megatron_h2.errors import ConfigError


def pad_vocab_size(vocab_size: int, multiple: int) -> int:
    """The vocabulary rounded up to a multiple of ``multiple`` (``--make-vocab-size-divisible-by``).

    Unlike Megatron the TP degree is not folded in, so the model (and its checkpoints) is the
    same under every layout, heterogeneous ones included; every stage's TP must divide the result.
    """
    return -(-vocab_size // multiple) * multiple


def swiglu_ffn_size(hidden_size: int) -> int:
    """Megatron's default SwiGLU width: 2/3 of 4h, rounded down to a multiple of 64."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64


NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")
Activation = Literal["gelu", "gelu_tanh", "swiglu", "squared_relu"]
RECOMPUTE_METHODS = ("uniform", "block")
ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")
TRANSFORMER_IMPLS = ("local", "transformer_engine")

LLAMA_ARCHITECTURE: dict[str, Any] = {
    "normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
    "add_bias_linear": False, "untie_embeddings_and_output_weights": True}
"""The :class:`ModelConfig` fields of a LLaMA-style model (Megatron's LLaMA flags ``--swiglu
--normalization RMSNorm --position-embedding-type rope --disable-bias-linear
--untie-embeddings-and-output-weights``); grouped-query attention is set separately."""

ARCHITECTURE_FIELDS: tuple[str, ...] = (
    "group_query_attention", "num_query_groups", "kv_channels", "ffn_hidden_size",
    "normalization", "apply_layernorm_1p", "norm_epsilon", "swiglu", "squared_relu",
    "bias_gelu_fusion", "add_bias_linear", "add_qkv_bias", "untie_embeddings_and_output_weights",
    "position_embedding_type", "rotary_percent", "rotary_base",
    "rotary_seq_len_interpolation_factor", "use_rope_scaling", "rope_scaling_factor",
    "num_experts", "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_topk",
    "moe_router_score_function", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
    "moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_group_topk",
    "moe_shared_expert_intermediate_size", "moe_shared_expert_gate")
"""Fields beyond the shape (layers, hidden size, heads, vocabulary) that change the weights or
what they compute: a checkpoint's must equal the run's, and the planner's model files and
launch scripts carry them (``max_position_embeddings``, the size of a learned position table, is
checked by the tensor shapes)."""


@dataclass
class ModelConfig(ModelCounts, MoEFields):
    """The decoder Megatron builds for the same flags (Megatron's defaults are a GPT: LayerNorm
    with bias, GeLU MLP of 4h with biases, learned absolute positions, embedding tied to the
    output layer); Megatron's LLaMA flags (:data:`LLAMA_ARCHITECTURE`) give a LLaMA."""

    # The shape flags are required on the command line (as in Megatron) except for the embedded
    # demo, which uses these defaults.
    num_layers: int = flag(4, "Number of transformer layers.", required=True)
    hidden_size: int = flag(256, "Transformer hidden size.", required=True)
    num_attention_heads: int = flag(8, "Number of transformer attention heads.", required=True)
    group_query_attention: bool = flag(
        False, "Use grouped-query attention (--num-query-groups key/value heads); without it "
        "every head has its own key and value, whatever --num-query-groups says (as Megatron).")
    num_query_groups: int | None = flag(
        None, "Number of query groups (key/value heads) with --group-query-attention; default: "
        "1 with --group-query-attention, else one per head.")
    kv_channels: int | None = flag(
        None, "Projection weights dimension in multi-head attention (the head dimension); "
        "default: --hidden-size / --num-attention-heads.")
    ffn_hidden_size: int | None = flag(
        None, "Transformer feed-forward network hidden size; default: 4 x --hidden-size, or "
        "with --swiglu 2/3 of that rounded down to a multiple of 64.")
    seq_length: int = flag(128, "Maximum sequence length to process.", required=True)
    max_position_embeddings: int | None = flag(
        None, "Maximum number of position embeddings (the size of the learned position table); "
        "default: --seq-length.")
    normalization: str = flag("LayerNorm", "Normalization layer (LayerNorm has a bias).",
                              choices=NORMALIZATIONS)
    apply_layernorm_1p: bool = flag(
        False, "Zero-centred norm scales: weights start at 0 and the norm multiplies by "
        "(1 + weight).")
    norm_epsilon: float = flag(1e-5, "Epsilon for layer norm and RMS norm.")
    swiglu: bool = flag(False, "Use gated linear units and SiLU activation instead of GeLU.")
    squared_relu: bool = flag(False, "Use squared ReLU activation instead of GeLU.")
    bias_gelu_fusion: bool = flag(
        True, "Megatron's fused bias + GeLU, which computes the tanh approximation of GeLU; "
        "--no-bias-gelu-fusion (or --disable-bias-linear) gives the exact (erf) GeLU.",
        name="--no-bias-gelu-fusion", negative=True)
    add_bias_linear: bool = flag(
        True, "Biases in every linear layer (QKV, attention output, both MLP layers); "
        "--disable-bias-linear removes them.", name="--disable-bias-linear", negative=True)
    add_qkv_bias: bool = flag(False, "Add a bias to the QKV projection only (implied by the "
                              "biases of every linear layer).")
    untie_embeddings_and_output_weights: bool = flag(
        False, "Separate weights for the input embedding and the output layer (default: one "
        "tied weight).")
    position_embedding_type: str = flag(
        "learned_absolute", "Position embedding type.", choices=POSITION_EMBEDDING_TYPES,
        shortcuts=(("--use-rotary-position-embeddings", "rope",
                    "Megatron's older spelling of --position-embedding-type rope."),))
    rotary_percent: float = flag(1.0, "Fraction of each head's dimensions that rotary "
                                 "embeddings rotate.")
    rotary_base: float = flag(10000.0, "Base to use for rotary positional embeddings.")
    rotary_seq_len_interpolation_factor: int | None = flag(
        None, "Divide positions by this factor before the rotary embedding (linear position "
        "interpolation).")
    use_rope_scaling: bool = flag(False, "Apply Llama 3.x rope scaling to the rotary "
                                  "frequencies.")
    rope_scaling_factor: float = flag(8.0, "Rope scaling factor in Llama 3.x models.")
    init_method_std: float = flag(
        0.02, "Standard deviation of the zero mean normal distribution used for weight "
        "initialization (scaled by 1/sqrt(2 x layers) for each layer's output projections).")
    hidden_dropout: float = flag(0.1, "Dropout probability for hidden state transformer.")
    attention_dropout: float = flag(0.1, "Post attention dropout probability.")
    recompute: Recompute = flag(
        "none", "Checkpoint activations to fit larger models: full (whole layers, chosen by "
        "--recompute-method and --recompute-num-layers) or selective (core attention).",
        name="--recompute-granularity", choices=("full", "selective"), shortcuts=(
            ("--recompute-activations", "selective",
             "Megatron's shorthand for --recompute-granularity selective."),))
    recompute_method: str | None = flag(
        None, "With --recompute-granularity full: uniform (checkpoint groups of "
        "--recompute-num-layers consecutive layers, keeping only each group's input) or block "
        "(checkpoint the first --recompute-num-layers layers of every pipeline stage's model "
        "chunk, run the rest without recompute).", choices=RECOMPUTE_METHODS)
    recompute_num_layers: int | None = flag(
        None, "Layers per recomputed group (uniform) or recomputed layers per model chunk "
        "(block).")
    attention_backend: str = flag(
        "auto", "Attention kernel (torch's scaled_dot_product_attention backends): flash "
        "(FlashAttention), fused (cuDNN, else memory-efficient fused attention), unfused and "
        "local (the math implementation), auto (torch chooses); a backend the device cannot run "
        "for this model is an error at start-up.", choices=ATTENTION_BACKENDS)
    use_flash_attn: bool = flag(False, "Use FlashAttention (same as --attention-backend flash).")
    transformer_impl: str = flag(
        "local", "Transformer implementation: local (megatron_h2's layers) or transformer_engine "
        "(core attention from NVIDIA Transformer Engine, which must be installed).",
        choices=TRANSFORMER_IMPLS)
    fp8_format: str | None = flag(
        None, "FP8 training (e4m3 or hybrid); needs Transformer Engine's FP8 layers on an NVIDIA "
        "Hopper-or-newer GPU, which megatron_h2 does not build: an error at start-up.",
        choices=("e4m3", "hybrid"))
    fp8_recipe: str = flag("delayed", "FP8 scaling recipe (with --fp8-format).",
                           choices=("delayed", "tensorwise", "mxfp8", "blockwise"))
    fp8_margin: int = flag(0, "Scaling margin for FP8 (with --fp8-format).")
    fp8_amax_history_len: int = flag(1, "Number of steps of amax history kept for FP8 scaling "
                                     "(with --fp8-format).")
    fp8_amax_compute_algo: str = flag("most_recent", "How FP8 scales come from the amax "
                                      "history (with --fp8-format).",
                                      choices=("most_recent", "max"))
    fp8_param_gather: bool = flag(False, "Keep the compute parameters in FP8 and all-gather them "
                                  "in FP8 (with --fp8-format).")
    first_last_layers_bf16: bool = flag(False, "Keep the first and last transformer layers in "
                                        "bf16 under FP8 training (with --fp8-format).")
    vocab_size: int = 0  # padded vocabulary size; filled in from the tokenizer at start-up

    def __post_init__(self) -> None:
        self._fill_defaults()
        _positive(self, "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                  "kv_channels", "ffn_hidden_size", "seq_length", "max_position_embeddings",
                  "norm_epsilon", "rotary_base", "rope_scaling_factor")
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(
                f"--num-query-groups {self.num_query_groups} does not divide --num-attention-heads "
                f"{self.num_attention_heads}; use a divisor of the head count")
        if self.seq_length > self.max_position_embeddings:
            raise ConfigError(
                f"--seq-length {self.seq_length} exceeds --max-position-embeddings "
                f"{self.max_position_embeddings}; raise --max-position-embeddings or shorten "
                "--seq-length")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"--{name.replace('_', '-')} must be in [0, 1)")
        if self.recompute not in RECOMPUTE_MODES:
            raise ConfigError(f"recompute must be none, selective or full, got {self.recompute!r}")
        self._check_recompute()
        self._check_architecture()
        self._check_implementation()
        self._check_moe()

    def _fill_defaults(self) -> None:
        """Megatron's rules for the sizes left unset."""
        if not self.group_query_attention:
            self.num_query_groups = self.num_attention_heads
        elif self.num_query_groups is None:
            self.num_query_groups = 1
        if self.kv_channels is None:
            if self.num_attention_heads > 0 and self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                    f"{self.num_attention_heads}; choose a hidden size that is a multiple of the "
                    "heads or set --kv-channels")
            self.kv_channels = self.hidden_size // max(self.num_attention_heads, 1)
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = (swiglu_ffn_size(self.hidden_size) if self.swiglu
                                    else 4 * self.hidden_size)
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.add_bias_linear:
            self.add_qkv_bias = True  # Megatron keeps the two in sync
        self._fill_moe_defaults()

    def _check_recompute(self) -> None:
        """Megatron's rules: a method and a layer count only with full recompute. ``full``
        without a method (a plan's per-stage setting) recomputes every layer; the command line
        asks for the method as Megatron does (see ``megatron_h2.training.arguments``)."""
        method, count = self.recompute_method, self.recompute_num_layers
        if method is not None and method not in RECOMPUTE_METHODS:
            raise ConfigError(f"--recompute-method must be uniform or block, got {method!r}")
        if self.recompute != "full" and (method is not None or count is not None):
            raise ConfigError("--recompute-method and --recompute-num-layers need "
                              "--recompute-granularity full (selective recompute has no method "
                              "or layer count)")
        if (method is None) != (count is None):
            raise ConfigError("--recompute-method and --recompute-num-layers go together: give "
                              "both (e.g. --recompute-method uniform --recompute-num-layers 1)")
        if count is not None and not 1 <= count <= self.num_layers:
            raise ConfigError(f"--recompute-num-layers must be between 1 and --num-layers "
                              f"{self.num_layers}, got {count}")

    def _check_implementation(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}"
                              f", got {self.attention_backend!r}")
        if self.use_flash_attn:
            if self.attention_backend not in ("auto", "flash"):
                raise ConfigError(f"--use-flash-attn asks for flash attention but "
                                  f"--attention-backend is {self.attention_backend}; give one")
            self.attention_backend = "flash"
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise ConfigError(f"--transformer-impl must be local or transformer_engine, got "
                              f"{self.transformer_impl!r}")
        if self.fp8_amax_history_len <= 0:
            raise ConfigError("--fp8-amax-history-len must be a positive number of steps")

    def recompute_groups(self, layers: Sequence[int]) -> list[tuple[list[int], bool]]:
        """How one model chunk's ``layers`` run: ``(group, checkpointed)`` in order. Full
        recompute, uniform: groups of ``--recompute-num-layers`` consecutive layers, each
        checkpointed as one (only the group's input is kept; the last group may be shorter);
        block: the first ``--recompute-num-layers`` layers checkpointed one by one, the rest
        plain. ``full`` without a method (a plan's stage setting) checkpoints every layer."""
        layers = list(layers)
        if self.recompute != "full":
            return [([i], False) for i in layers]
        count = self.recompute_num_layers or 1
        if self.recompute_method == "block":
            return [([i], n < count) for n, i in enumerate(layers)]
        return [(layers[n:n + count], True) for n in range(0, len(layers), count)]

    def _check_architecture(self) -> None:
        if self.normalization not in NORMALIZATIONS:
            raise ConfigError(f"--normalization must be LayerNorm or RMSNorm, got "
                              f"{self.normalization!r}")
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ConfigError(f"--position-embedding-type must be one of "
                              f"{', '.join(POSITION_EMBEDDING_TYPES)}, got "
                              f"{self.position_embedding_type!r}")
        if self.swiglu and self.squared_relu:
            raise ConfigError("--swiglu and --squared-relu are different activations; give one")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ConfigError(f"--rotary-percent must be in (0, 1], got {self.rotary_percent}")
        if self.position_embedding_type == "rope" and (self.rotary_dim < 2 or self.rotary_dim % 2):
            raise ConfigError(
                f"rotary embeddings need an even number of rotated dimensions, got "
                f"{self.rotary_dim} (--kv-channels {self.kv_channels} x --rotary-percent "
                f"{self.rotary_percent:g})")
        factor = self.rotary_seq_len_interpolation_factor
        if factor is not None and factor < 1:
            raise ConfigError(f"--rotary-seq-len-interpolation-factor must be >= 1, got {factor}")

    # ------------------------------------------------------------------ derived architecture
    @property
    def activation(self) -> Activation:
        """The MLP's activation as Megatron computes it for these flags: SwiGLU, squared ReLU, or
        GeLU - the tanh approximation of Megatron's fused bias-GeLU when the MLP has biases and
        the fusion is on (the default), else the exact erf GeLU."""
        if self.swiglu:
            return "swiglu"
        if self.squared_relu:
            return "squared_relu"
        return "gelu_tanh" if self.add_bias_linear and self.bias_gelu_fusion else "gelu"

    @property
    def tied_embeddings(self) -> bool:
        """True when the output layer uses the input embedding's weight."""
        return not self.untie_embeddings_and_output_weights

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that rotary embeddings rotate (Megatron's rounding)."""
        dim = self.kv_channels
        return int(dim * self.rotary_percent) if self.rotary_percent < 1.0 else dim

    def describe_architecture(self) -> str:
        """One phrase such as ``LayerNorm, GeLU (tanh) MLP with biases, learned positions, tied
        embedding``."""
        norm = self.normalization + (" (1p)" if self.apply_layernorm_1p else "")
        act = {"gelu": "GeLU", "gelu_tanh": "GeLU (tanh)", "swiglu": "SwiGLU",
               "squared_relu": "squared-ReLU"}[self.activation]
        bias = ("with biases" if self.add_bias_linear
                else "QKV bias only" if self.add_qkv_bias else "no biases")
        pos = {"learned_absolute": "learned positions", "none": "no positions",
               "rope": f"rotary positions (base {self.rotary_base:g})",
               }[self.position_embedding_type]
        if self.position_embedding_type == "rope" and self.rotary_percent < 1.0:
            pos += f" on {self.rotary_percent:g} of each head"
        if self.position_embedding_type == "rope" and self.use_rope_scaling:
            pos += f", Llama 3 scaling x{self.rope_scaling_factor:g}"
        tied = "tied embedding" if self.tied_embeddings else "untied embedding and output"
        moe = f"; {self.describe_moe()}" if self.is_moe else ""
        return f"{norm}, {act} MLP {bias}, {pos}, {tied}{moe}"
