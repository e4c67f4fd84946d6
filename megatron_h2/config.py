"""Typed configuration for a training run, and the one description of the model.

Each dataclass validates its own fields in ``__post_init__`` and raises
:class:`~megatron_h2.errors.ConfigError` with one line that says what to fix. A field declared
with :func:`flag` is a command-line flag: ``megatron_h2/training/arguments.py`` generates the
parser from these declarations (name, help, choices), so the defaults here are the command
line's, and they are Megatron-LM's wherever Megatron has the flag.

:class:`ModelConfig` is what both the runtime builds (``megatron_h2.models``) and the planner
plans for (``megatron_h2.planner``): its parameter counts, FLOPs and activation bytes (from its
base :class:`~megatron_h2.model_counts.ModelCounts`), the vocabulary padding
(:func:`pad_vocab_size`) and :func:`state_bytes_per_param` are the only ones in the project.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from megatron_h2.errors import ConfigError
from megatron_h2.model_counts import RECOMPUTE_MODES, ModelCounts, Recompute

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")


def flag(default: Any = None, help: str = "", *, name: str | None = None,
         choices: tuple | None = None, negative: bool = False, required: bool = False,
         parse: Callable[[str], Any] | None = None, metavar: str | None = None,
         shortcuts: tuple[tuple[str, Any, str], ...] = (), unless: tuple[str, ...] = (),
         nargs: int | None = None) -> Any:
    """A dataclass field that is also a command-line flag.

    ``name`` overrides the flag (default ``--field-name``); ``negative`` makes a bool flag that
    sets the field to False (Megatron's ``--disable-...`` / ``--no-...`` flags); ``required``
    flags must be given unless the run is the embedded demo, or one of the fields in ``unless``
    (the alternatives, e.g. ``--train-samples`` for ``--train-iters``; the embedded demo's value
    for the field is dropped when one of them is given) is given; ``parse``
    converts the text; ``shortcuts`` are extra flags ``(flag, value, help)`` that set the field
    to a fixed value; ``nargs`` fixes the number of values of a list flag.
    """
    meta = {"help": help, "name": name, "choices": choices, "negative": negative,
            "required": required, "parse": parse, "metavar": metavar, "shortcuts": shortcuts,
            "unless": unless, "nargs": nargs}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"cli": meta})
    return field(default=default, metadata={"cli": meta})


def cli_fields(cls: type) -> list:
    """The fields of a config dataclass that are command-line flags, in declaration order."""
    return [f for f in fields(cls) if "cli" in f.metadata]


def flag_name(f) -> str:
    """The command-line flag of a :func:`flag` field."""
    return f.metadata["cli"]["name"] or "--" + f.name.replace("_", "-")


def int_list(text: str) -> list[int]:
    """``"3,1"`` -> ``[3, 1]`` (a comma-separated flag value)."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"expected comma-separated integers such as 3,1, got {text!r}") from None


_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _count(text: str) -> int:
    """``"2.4B"`` -> 2400000000 (Megatron's K / M / B / T suffixes)."""
    text = text.strip().upper()
    scale = _SUFFIXES.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in _SUFFIXES else text
    value = float(number)
    if not value >= 0 or value != value:
        raise ValueError(text)
    return int(value * scale)


def parse_batch_size_schedule(text: str) -> list[tuple[int, int]]:
    """``"0:16 2.4B:320"`` -> ``[(0, 16), (2400000000, 320)]`` (threshold, global batch size),
    sorted by threshold, as Megatron's ``--step-batch-size-schedule`` (thresholds are tokens)."""
    hint = "use \"THRESHOLD:BATCH ...\" such as \"0:16 2.4B:320 12B:1536\""
    steps = []
    for entry in text.strip().strip("'\"").replace(",", " ").split():
        threshold, sep, batch = entry.partition(":")
        try:
            if not sep:
                raise ValueError(entry)
            steps.append((_count(threshold), _count(batch)))
        except ValueError:
            raise ConfigError(f"--step-batch-size-schedule entry {entry!r} is not "
                              f"THRESHOLD:BATCH; {hint}") from None
    steps.sort()
    if not steps or steps[0][0] != 0:
        raise ConfigError(f"--step-batch-size-schedule must start at threshold 0; {hint}")
    if any(a[0] == b[0] for a, b in zip(steps, steps[1:])):
        raise ConfigError("--step-batch-size-schedule repeats a threshold; give each once")
    if any(batch <= 0 for _, batch in steps):
        raise ConfigError("--step-batch-size-schedule batch sizes must be positive")
    return steps


def _required(obj: object, *names: str) -> None:
    for name in names:
        if getattr(obj, name) is None:
            raise ConfigError(f"--{name.replace('_', '-')} is required")


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is None or value <= 0:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} must be a positive number, got {value}")


def pad_vocab_size(vocab_size: int, multiple: int) -> int:
    """The vocabulary rounded up to a multiple of ``multiple`` (``--make-vocab-size-divisible-by``).

    Unlike Megatron the TP degree is not folded in, so the model (and its checkpoints) is the
    same under every layout, heterogeneous ones included; every stage's TP must divide the result.
    """
    return -(-vocab_size // multiple) * multiple


def state_bytes_per_param(bf16_params: bool, data_parallel_size: int = 1,
                          distributed_optimizer: bool = False) -> float:
    """Bytes of model state per parameter: weight, fp32 gradient, optimizer.

    The optimizer keeps Adam's two fp32 moments (8 bytes) and, with bf16 weights (Megatron's
    mixed precision) or under the distributed optimizer (ZeRO-1), an fp32 main copy of the
    weights (4 bytes); the distributed optimizer shards both over DP. bf16 replicated:
    2 + 4 + 12 = 18; bf16 ZeRO-1: 6 + 12/DP; fp32 replicated: 4 + 4 + 8 = 16; fp32 ZeRO-1:
    8 + 12/DP.
    """
    weight = 2.0 if bf16_params else 4.0
    optimizer = 12.0 if bf16_params or distributed_optimizer else 8.0
    if distributed_optimizer:
        optimizer /= data_parallel_size
    return weight + 4.0 + optimizer


def swiglu_ffn_size(hidden_size: int) -> int:
    """Megatron's default SwiGLU width: 2/3 of 4h, rounded down to a multiple of 64."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64


NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")
Activation = Literal["gelu", "gelu_tanh", "swiglu", "squared_relu"]

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
    "rotary_seq_len_interpolation_factor", "use_rope_scaling", "rope_scaling_factor")
"""Fields beyond the shape (layers, hidden size, heads, vocabulary) that change the weights or
what they compute: a checkpoint's must equal the run's, and the planner's model files and
launch scripts carry them (``max_position_embeddings``, the size of a learned position table, is
checked by the tensor shapes)."""


@dataclass
class ModelConfig(ModelCounts):
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
        "none", "Checkpoint activations to fit larger models: full (whole layers) or selective "
        "(core attention and the MLP activation).", name="--recompute-granularity",
        choices=("full", "selective"), shortcuts=(
            ("--recompute-activations", "selective",
             "Megatron's shorthand for --recompute-granularity selective."),))
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
        self._check_architecture()

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
        return f"{norm}, {act} MLP {bias}, {pos}, {tied}"


TOKENIZER_TYPES = ("GPT2BPETokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer",
                   "Llama2Tokenizer", "NullTokenizer", "SentencePieceTokenizer", "TikTokenizer")
LEGACY_SPLIT = "969, 30, 1"
"""Megatron's split when --data-path comes without --split."""
MOCK_SPLIT = "1,1,1"
"""Megatron's split of --mock-data (it ignores --split)."""


@dataclass
class DataConfig:
    """Where the tokens come from and how text becomes tokens. Without any data source the run
    is the embedded demo (its own corpus and tokenizer)."""

    data_path: list[str] = flag(
        [], "PREFIX [PREFIX ...] (blended by size) or W1 PREFIX1 W2 PREFIX2 ... of Megatron "
        ".bin/.idx files, cut into training / validation / test documents by --split; default: "
        "the embedded demo corpus built from the Python standard library.", metavar="PATH")
    split: str | None = flag(
        None, "Comma-separated proportions for training, validation and test documents, e.g. "
        "99,1,0 (quotes and spaces are ignored); default with --data-path: '969, 30, 1'.")
    train_data_path: list[str] = flag(
        [], "Weights and prefixes (as --data-path) of a separate training dataset, used whole.",
        metavar="PATH")
    valid_data_path: list[str] = flag(
        [], "Weights and prefixes of a separate validation dataset, used whole.", metavar="PATH")
    test_data_path: list[str] = flag(
        [], "Weights and prefixes of a separate test dataset, used whole.", metavar="PATH")
    mock_data: bool = flag(False, "Train on synthetic documents instead of files (Megatron's "
                           "MockGPTDataset); the split is then 1,1,1.")
    mmap_bin_files: bool = flag(True, "Read the .bin files with file reads instead of "
                                "memory-mapping them; default: memory-mapped.",
                                name="--no-mmap-bin-files", negative=True)
    tokenizer_type: str = flag("GPT2BPETokenizer", "What type of tokenizer to use.",
                               choices=TOKENIZER_TYPES)
    tokenizer_model: str | None = flag(
        None, "Tokenizer model: SentencePiece .model file (SentencePieceTokenizer, "
        "GPTSentencePieceTokenizer, Llama2Tokenizer), tiktoken .json vocabulary (TikTokenizer) "
        "or Hugging Face tokenizer directory (HuggingFaceTokenizer).")
    vocab_file: str | None = flag(None, "Path to the vocab file (GPT2BPETokenizer: vocab.json).")
    merge_file: str | None = flag(None, "Path to the BPE merge file (GPT2BPETokenizer: "
                                  "merges.txt).")
    vocab_size: int | None = flag(
        None, "Size of the vocabulary before padding: NullTokenizer's ids are 0..N-1 with eod "
        "N-1; TikTokenizer's vocabulary (default 131072).")
    tiktoken_pattern: str | None = flag(None, "Pre-tokenization pattern of TikTokenizer; "
                                        "default: v2.", choices=("v1", "v2"))
    tiktoken_num_special_tokens: int = flag(
        1000, "Number of special tokens at the start of TikTokenizer's vocabulary.")
    tokenizer_special_tokens: list[str] | None = flag(
        None, "TikTokenizer's special tokens (must include <unk> <s> </s> <mask> <pad> <cls> "
        "<sep>); default: those seven.", metavar="TOKEN")
    null_tokenizer_eod_id: int | None = flag(
        None, "EOD token id of NullTokenizer; default: --vocab-size - 1.")
    tokenizer_hf_no_include_special_tokens: bool = flag(
        False, "HuggingFaceTokenizer: do not add the tokenizer's special tokens (e.g. BOS) when "
        "converting text to ids.")
    make_vocab_size_divisible_by: int = flag(
        128, "Pad the vocabulary to be divisible by this value (not multiplied by the TP size, "
        "so every layout builds the same model).")
    data_cache_path: str | None = flag(None, "Directory to hold cached index files.")
    eod_mask_loss: bool = flag(False, "Mask loss for the end of document tokens (positions "
                               "whose input token is the tokenizer's eod).")

    def __post_init__(self) -> None:
        _positive(self, "make_vocab_size_divisible_by")
        per_split = self.per_split_paths
        sources = [name for name, used in (("--data-path", self.data_path),
                                           ("--mock-data", self.mock_data),
                                           ("--train/valid/test-data-path", per_split))
                   if used]
        if len(sources) > 1:
            raise ConfigError(f"give one data source, not {' and '.join(sources)}")
        if per_split and self.split is not None:
            raise ConfigError("--split applies to --data-path; the --train/valid/test-data-path "
                              "datasets are used whole, so drop --split")
        if per_split and not self.train_data_path:
            raise ConfigError("--valid-data-path / --test-data-path need --train-data-path")
        if self.tiktoken_num_special_tokens < 0:
            raise ConfigError("--tiktoken-num-special-tokens must be >= 0")
        if self.vocab_size is not None:
            _positive(self, "vocab_size")

    @property
    def per_split_paths(self) -> bool:
        """Whether separate --train/valid/test-data-path datasets are given."""
        return bool(self.train_data_path or self.valid_data_path or self.test_data_path)

    @property
    def has_source(self) -> bool:
        """Whether the run names its data (otherwise it is the embedded demo)."""
        return bool(self.data_path or self.mock_data or self.per_split_paths)

    def effective_split(self) -> str:
        """The split the datasets are cut by: 1,1,1 for --mock-data (Megatron), --split, or
        Megatron's legacy default."""
        if self.mock_data:
            return MOCK_SPLIT
        return self.split if self.split is not None else LEGACY_SPLIT

    def tokenizer_options(self) -> dict[str, Any]:
        """The keyword arguments of ``megatron_h2.data.build_tokenizer`` beyond type, model and
        vocabulary size."""
        return {"vocab_file": self.vocab_file, "merge_file": self.merge_file,
                "tiktoken_pattern": self.tiktoken_pattern,
                "tiktoken_num_special_tokens": self.tiktoken_num_special_tokens,
                "special_tokens": self.tokenizer_special_tokens,
                "null_tokenizer_eod_id": self.null_tokenizer_eod_id,
                "hf_include_special_tokens": not self.tokenizer_hf_no_include_special_tokens}

    def padded_vocab_size(self, vocab_size: int) -> int:
        """The model's vocabulary for a tokenizer of ``vocab_size`` (see :func:`pad_vocab_size`)."""
        return pad_vocab_size(vocab_size, self.make_vocab_size_divisible_by)


@dataclass
class OptimizerConfig:
    """AdamW and Megatron's optimizer-parameter schedule: learning rate (warm-up from
    ``--lr-warmup-init``, then decay to ``--min-lr``) and weight decay (constant or increasing
    from ``--start-weight-decay`` to ``--end-weight-decay``), counted in samples as in
    Megatron (``megatron_h2.optimizer.lr_schedule``)."""

    optimizer: str = flag("adam", "Optimizer function (Adam with decoupled weight decay).",
                          choices=("adam",))
    lr: float = flag(1e-3, "Initial learning rate (the peak after warm-up).", required=True)
    min_lr: float = flag(0.0, "Minimum value for learning rate.")
    lr_warmup_iters: int = flag(0, "Number of iterations to linearly warm up the learning rate.",
                                unless=("train_samples", "lr_warmup_fraction"))
    lr_warmup_samples: int = flag(0, "Number of samples to linearly warm up the learning rate "
                                  "(sample-based training, --train-samples).")
    lr_warmup_fraction: float | None = flag(
        None, "Fraction of the decay length (--lr-decay-iters / --lr-decay-samples) to warm up "
        "over, instead of --lr-warmup-iters / --lr-warmup-samples.")
    lr_warmup_init: float = flag(0.0, "Initial value for learning rate warm-up; the scheduler "
                                 "starts warm-up from this value.")
    lr_decay_style: str = flag("linear", "Learning rate decay function.", choices=LR_DECAY_STYLES)
    lr_decay_iters: int | None = flag(None, "Iterations to decay the learning rate over; "
                                      "default: --train-iters.")
    lr_decay_samples: int | None = flag(None, "Samples to decay the learning rate over; "
                                        "default: --train-samples.")
    lr_wsd_decay_style: str = flag("exponential", "Decay style of the annealing phase of WSD.",
                                   choices=WSD_DECAY_STYLES)
    lr_wsd_decay_iters: int | None = flag(None, "Iterations of the annealing phase of WSD.")
    lr_wsd_decay_samples: int | None = flag(None, "Samples of the annealing phase of WSD.")
    decoupled_lr: float | None = flag(
        None, "Separate learning rate for the input embedding and output layer weights.")
    decoupled_min_lr: float | None = flag(
        None, "Minimum learning rate for the input embedding and output layer weights "
        "(with --decoupled-lr); default: --min-lr.")
    override_opt_param_scheduler: bool = flag(
        False, "On resume, take the schedule (learning rates, warm-up, decay length and style, "
        "weight decay) from this command line instead of the checkpoint.",
        name="--override-opt_param-scheduler", shortcuts=(
            ("--override-opt-param-scheduler", True, "Same as --override-opt_param-scheduler."),))
    use_checkpoint_opt_param_scheduler: bool = flag(
        False, "On resume, take the schedule from the checkpoint and ignore the command line's.",
        name="--use-checkpoint-opt_param-scheduler", shortcuts=(
            ("--use-checkpoint-opt-param-scheduler", True,
             "Same as --use-checkpoint-opt_param-scheduler."),))
    weight_decay: float = flag(0.01, "Weight decay coefficient for L2 regularization.")
    start_weight_decay: float | None = flag(
        None, "Initial weight decay coefficient (with --weight-decay-incr-style linear|cosine).")
    end_weight_decay: float | None = flag(
        None, "End-of-run weight decay coefficient (with --weight-decay-incr-style "
        "linear|cosine).")
    weight_decay_incr_style: str = flag("constant", "Weight decay increment function.",
                                        choices=WD_INCR_STYLES)
    adam_beta1: float = flag(0.9, "First coefficient for computing running averages of gradient "
                             "and its square.")
    adam_beta2: float = flag(0.999, "Second coefficient for computing running averages of "
                             "gradient and its square.")
    adam_eps: float = flag(1e-8, "Term added to the denominator to improve numerical stability.")
    clip_grad: float = flag(1.0, "Gradient clipping based on global L2 norm (0: off).")

    def __post_init__(self) -> None:
        _required(self, "lr")
        _positive(self, "lr")
        if not 0.0 <= self.min_lr <= self.lr:
            raise ConfigError(f"--min-lr {self.min_lr} must be between 0 and --lr {self.lr}")
        if not 0.0 <= self.lr_warmup_init <= self.lr:
            raise ConfigError(f"--lr-warmup-init {self.lr_warmup_init} must be between 0 and "
                              f"--lr {self.lr}")
        if self.lr_warmup_iters < 0 or self.lr_warmup_samples < 0:
            raise ConfigError("--lr-warmup-iters and --lr-warmup-samples must be >= 0")
        for name in ("lr_decay_iters", "lr_decay_samples", "lr_wsd_decay_iters",
                     "lr_wsd_decay_samples"):
            if getattr(self, name) is not None:
                _positive(self, name)
        if self.lr_warmup_fraction is not None and not 0.0 <= self.lr_warmup_fraction < 1.0:
            raise ConfigError(f"--lr-warmup-fraction {self.lr_warmup_fraction} must be in [0, 1)")
        for value, choices, name in ((self.lr_decay_style, LR_DECAY_STYLES, "lr-decay-style"),
                                     (self.lr_wsd_decay_style, WSD_DECAY_STYLES,
                                      "lr-wsd-decay-style"),
                                     (self.weight_decay_incr_style, WD_INCR_STYLES,
                                      "weight-decay-incr-style")):
            if value not in choices:
                raise ConfigError(f"--{name} must be one of {', '.join(choices)}, got {value!r}")
        if self.weight_decay < 0 or self.clip_grad < 0:
            raise ConfigError("--weight-decay and --clip-grad must be >= 0 (0 disables clipping)")
        self._check_decoupled()
        self._check_weight_decay_schedule()
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ConfigError("--override-opt_param-scheduler and "
                              "--use-checkpoint-opt_param-scheduler exclude each other; give one")

    def _check_decoupled(self) -> None:
        if self.decoupled_lr is None:
            if self.decoupled_min_lr is not None:
                raise ConfigError("--decoupled-min-lr needs --decoupled-lr (the embedding and "
                                  "output layer otherwise follow --lr / --min-lr)")
            return
        low = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
        if not 0.0 <= low <= self.decoupled_lr:
            raise ConfigError(f"the embedding/output layer minimum learning rate {low} "
                              "(--decoupled-min-lr, default --min-lr) must be between 0 and "
                              f"--decoupled-lr {self.decoupled_lr}")
        if self.lr_warmup_init > self.decoupled_lr:
            raise ConfigError(f"--lr-warmup-init {self.lr_warmup_init} exceeds --decoupled-lr "
                              f"{self.decoupled_lr}")

    def _check_weight_decay_schedule(self) -> None:
        start, end = self.start_weight_decay, self.end_weight_decay
        if self.weight_decay_incr_style == "constant":
            if start is not None or end is not None:
                raise ConfigError("--start-weight-decay / --end-weight-decay need "
                                  "--weight-decay-incr-style linear or cosine (the constant "
                                  "style uses --weight-decay)")
            return
        if start is None or end is None:
            raise ConfigError(f"--weight-decay-incr-style {self.weight_decay_incr_style} needs "
                              "both --start-weight-decay and --end-weight-decay")
        if not 0.0 <= start <= end:
            raise ConfigError(f"weight decay must increase: need 0 <= --start-weight-decay "
                              f"{start} <= --end-weight-decay {end}")

    @property
    def start_wd(self) -> float:
        """Weight decay at the first step (``--weight-decay`` unless it increases)."""
        return self.weight_decay if self.start_weight_decay is None else self.start_weight_decay

    @property
    def end_wd(self) -> float:
        """Weight decay at the end of training."""
        return self.weight_decay if self.end_weight_decay is None else self.end_weight_decay


@dataclass
class TrainingConfig:
    """Batching, length of the run, precision, logging and checkpoint cadence."""

    micro_batch_size: int = flag(4, "Batch size per model instance (local batch size).",
                                 required=True)
    global_batch_size: int | None = flag(
        None, "Training batch size (after any ramp-up); default: --micro-batch-size x "
        "data-parallel size, or the last batch size of --step-batch-size-schedule.",
        unless=("step_batch_size_schedule",))
    rampup_batch_size: list[int] | None = flag(
        None, "Batch size ramp-up START INCREMENT SAMPLES: start at global batch START and grow "
        "it by INCREMENT in equal shares of the first SAMPLES samples up to --global-batch-size "
        "(sample-based training, --train-samples).", nargs=3, metavar="N")
    step_batch_size_schedule: str | None = flag(
        None, "Global batch size by consumed tokens, \"THRESHOLD:BATCH ...\" with K/M/B/T "
        "suffixes, e.g. \"0:16 2.4B:320 12B:1536\" (a threshold is tokens, converted to samples "
        "with --seq-length).", metavar="SCHEDULE")
    train_iters: int | None = flag(None, "Total number of iterations to train over all training "
                                   "runs.", required=True, unless=("train_samples",))
    train_samples: int | None = flag(
        None, "Total number of samples to train over all training runs (instead of "
        "--train-iters; the iterations follow from the batch sizes).")
    seed: int = flag(1234, "Random seed used for python, numpy, torch and the data order.")
    bf16: bool = flag(False, "Run the model in bfloat16 mixed precision.")
    fp16: bool = flag(False, "Run the model in fp16 mixed precision (not supported yet: use "
                      "--bf16).")
    device: str | None = flag(None, "Torch device type to train on (cpu, cuda, npu, mlu, xpu); "
                              "default: detect.")
    log_interval: int = flag(100, "Report loss and timing interval.")
    eval_interval: int = flag(1000, "Interval between running evaluation on validation set.")
    eval_iters: int = flag(100, "Number of iterations to run for evaluation (0: none).")
    save: str | None = flag(None, "Output directory to save checkpoints to.")
    load: str | None = flag(None, "Directory containing a model checkpoint.")
    save_interval: int | None = flag(None, "Number of iterations between checkpoint saves.")
    tensorboard_dir: str | None = flag(None, "Write TensorBoard logs to this directory.")
    log_jsonl: str | None = flag(None, "Append one JSON object per logged iteration to this file.")
    timeline_trace: str | None = flag(
        None, "Write a Chrome/Perfetto trace of every rank's forward, backward, send and receive "
        "per micro-batch.")
    exit_interval: int | None = flag(
        None, "Exit the program (after saving) when the iteration is divisible by this value.")
    exit_duration_in_mins: float | None = flag(
        None, "Exit the program (after saving) once it has run this many minutes.")
    exit_signal_handler: bool = flag(
        False, "On --exit-signal (SIGTERM), save a checkpoint and shut down after the current "
        "iteration; without this flag the signal ends the process at once.")
    exit_signal: str = flag("SIGTERM", "Signal for --exit-signal-handler.", choices=tuple(
        s.name for s in signal.Signals if s.name not in ("SIGKILL", "SIGSTOP")))
    calculate_per_token_loss: bool = flag(
        False, "Average the loss over all tokens of the global batch instead of over each "
        "micro-batch's tokens first (they differ when --eod-mask-loss masks tokens).")
    precision_check_interval: int | None = flag(
        None, "Every N iterations, re-run the last micro-batch of each pipeline stage with every "
        "operator replayed on the CPU in fp64 and log the worst operator error per stage (off by "
        "default; each check costs a forward and backward of a micro-batch plus its fp64 replay: "
        "3-7 training iterations of CPU time on small CPU models, see "
        "bench/bench_precision_check.py; overhead about that / N).")

    def __post_init__(self) -> None:
        _required(self, "micro_batch_size")
        if self.fp16:
            raise ConfigError("--fp16 is not supported; use --bf16 (fp32 master weights, no loss "
                              "scaling needed)")
        _positive(self, "micro_batch_size", "log_interval", "eval_interval")
        self._check_length_and_batch()
        if self.global_batch_size is not None:
            _positive(self, "global_batch_size")
        if self.eval_iters < 0:
            raise ConfigError("--eval-iters must be >= 0 (0 disables evaluation)")
        if self.global_batch_size is not None and self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"--global-batch-size {self.global_batch_size} is not divisible by "
                f"--micro-batch-size {self.micro_batch_size}; make it a multiple")
        if self.save_interval is not None and self.save_interval <= 0:
            raise ConfigError("--save-interval must be a positive number of iterations")
        if self.exit_interval is not None and self.exit_interval <= 0:
            raise ConfigError("--exit-interval must be a positive number of iterations")
        if self.exit_duration_in_mins is not None and self.exit_duration_in_mins <= 0:
            raise ConfigError("--exit-duration-in-mins must be a positive number of minutes")

    def _check_length_and_batch(self) -> None:
        """Iteration- or sample-based length, and at most one batch-size schedule (as Megatron)."""
        if self.train_iters is not None and self.train_samples is not None:
            raise ConfigError("give either --train-iters or --train-samples, not both")
        for name in ("train_iters", "train_samples"):
            if getattr(self, name) is not None:
                _positive(self, name)
        if self.rampup_batch_size is not None:
            if self.step_batch_size_schedule is not None:
                raise ConfigError("give either --rampup-batch-size or --step-batch-size-schedule, "
                                  "not both")
            if self.train_iters is not None:
                raise ConfigError("--rampup-batch-size needs sample-based training: use "
                                  "--train-samples instead of --train-iters")
            start, increment, samples = self.rampup_batch_size
            if min(start, increment, samples) <= 0:
                raise ConfigError(f"--rampup-batch-size {start} {increment} {samples} needs a "
                                  "positive start batch, increment and number of samples")
        if self.step_batch_size_schedule is not None:
            final = parse_batch_size_schedule(self.step_batch_size_schedule)[-1][1]
            if self.global_batch_size not in (None, final):
                raise ConfigError(f"--global-batch-size {self.global_batch_size} differs from "
                                  f"the last batch size {final} of --step-batch-size-schedule; "
                                  "drop --global-batch-size")
            self.global_batch_size = final
        if self.precision_check_interval is not None and self.precision_check_interval <= 0:
            raise ConfigError("--precision-check-interval must be a positive number of "
                              "iterations (leave it out to turn the check off)")

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per step summed over DP replicas (after the layout set the batch)."""
        if self.global_batch_size is None:
            raise ValueError("global_batch_size is set from the layout at start-up")
        return self.global_batch_size // self.micro_batch_size


@dataclass
class ParallelConfig:
    """Uniform tensor / pipeline / data parallelism (Megatron's flags). DP is what remains of the
    world size after TP x PP. A heterogeneous plan file replaces the TP / PP fields."""

    tensor_model_parallel_size: int = flag(1, "Degree of tensor model parallelism.")
    pipeline_model_parallel_size: int = flag(1, "Degree of pipeline model parallelism.")
    pipeline_layer_split: list[int] | None = flag(
        None, "Layers per pipeline stage, e.g. 3,1 (embedding on the first stage, head and loss "
        "on the last).", parse=int_list, metavar="N,N,...")
    decoder_first_pipeline_num_layers: int | None = flag(
        None, "Transformer layers on the first pipeline stage (the rest spread evenly).")
    decoder_last_pipeline_num_layers: int | None = flag(
        None, "Transformer layers on the last pipeline stage (the rest spread evenly).")
    sequence_parallel: bool = flag(False, "Enable sequence parallel optimization.")
    use_distributed_optimizer: bool = flag(
        False, "Use the distributed optimizer (optimizer state sharded over data-parallel ranks, "
        "ZeRO-1).")
    distributed_timeout_minutes: float = flag(10.0, "Timeout minutes for torch.distributed.")
    ddp_bucket_size: int | None = flag(
        None, "Bucket size (elements) for data-parallel communication; default: "
        "max(40000000, 1000000 x data-parallel size).")
    overlap_grad_reduce: bool = flag(
        False, "Overlap the data-parallel gradient reduction with the last backward.")
    hetero_plan: str | None = flag(
        None, "YAML plan (tools/plan.py writes one): pipeline stages on chip types, each with its "
        "own TP, layers and recompute.")
    force_bridge: bool = flag(
        False, "Route every stage boundary through the host-staged cross-vendor bridge.")
    bridge_dtype: str = flag("fp32", "Precision of activations and gradients crossing the bridge.",
                             choices=("fp32", "bf16"))
    bridge_chunk_mb: float = flag(4.0, "Chunk size (MiB) of bridge transfers.")

    def bucket_size_mb(self, data_parallel_size: int) -> float:
        """The gradient bucket size in MiB of fp32 gradients (Megatron's default when unset)."""
        elements = self.ddp_bucket_size or max(40_000_000, 1_000_000 * data_parallel_size)
        return elements * 4 / 2**20

    def __post_init__(self) -> None:
        _positive(self, "tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "distributed_timeout_minutes", "bridge_chunk_mb")
        if self.ddp_bucket_size is not None:
            _positive(self, "ddp_bucket_size")
        if self.bridge_dtype not in ("fp32", "bf16"):
            raise ConfigError(f"--bridge-dtype must be fp32 or bf16, got {self.bridge_dtype!r}")
        if self.pipeline_layer_split is not None:
            if len(self.pipeline_layer_split) != self.pipeline_model_parallel_size:
                raise ConfigError(
                    f"--pipeline-layer-split has {len(self.pipeline_layer_split)} counts but "
                    f"--pipeline-model-parallel-size is {self.pipeline_model_parallel_size}; "
                    "give one layer count per stage")
            if any(n < 0 for n in self.pipeline_layer_split):
                raise ConfigError("--pipeline-layer-split counts must be >= 0")
            if (self.decoder_first_pipeline_num_layers is not None
                    or self.decoder_last_pipeline_num_layers is not None):
                raise ConfigError("use either --pipeline-layer-split or --decoder-first/last-"
                                  "pipeline-num-layers, not both")
        for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0")

    def stage_layers(self, num_layers: int) -> list[int]:
        """Layer count of every pipeline stage; counts that do not add up are an error."""
        pp = self.pipeline_model_parallel_size
        if self.pipeline_layer_split is not None:
            split = list(self.pipeline_layer_split)
            if sum(split) != num_layers:
                raise ConfigError(f"--pipeline-layer-split {','.join(map(str, split))} adds up "
                                  f"to {sum(split)} layers but --num-layers is {num_layers}")
            return split
        first, last = self.decoder_first_pipeline_num_layers, self.decoder_last_pipeline_num_layers
        if pp == 1:
            if first not in (None, num_layers) or last not in (None, num_layers):
                raise ConfigError("--decoder-first/last-pipeline-num-layers need "
                                  "--pipeline-model-parallel-size > 1")
            return [num_layers]
        fixed = [first, *([None] * (pp - 2)), last]
        rest = num_layers - sum(n for n in fixed if n is not None)
        free = sum(n is None for n in fixed)
        if rest < 0 or (free and rest % free) or (not free and rest):
            raise ConfigError(
                f"{num_layers} layers cannot be split over {pp} stages with first={first} and "
                f"last={last}: the remaining {rest} must divide evenly over {free} stage(s); "
                "use --pipeline-layer-split for an explicit split")
        return [n if n is not None else rest // free for n in fixed]


def check_schedule_units(opt: OptimizerConfig, training: TrainingConfig) -> None:
    """Iteration-based runs (``--train-iters``) count the schedule in iterations, sample-based
    runs (``--train-samples``) in samples; mixing them is an error, as in Megatron. Warm-up must
    end before the decay does."""
    if training.train_iters is not None:
        unit, other, length = "iters", "samples", training.train_iters
    elif training.train_samples is not None:
        unit, other, length = "samples", "iters", training.train_samples
    else:
        return  # the length is checked at launch (--train-iters or --train-samples)
    for name in (f"lr_decay_{other}", f"lr_warmup_{other}", f"lr_wsd_decay_{other}"):
        if getattr(opt, name):
            kind = "sample" if other == "samples" else "iteration"
            raise ConfigError(f"--{name.replace('_', '-')} needs {kind}-based training "
                              f"(--train-{other}); with --train-{unit} use the -{unit} flag")
    warmup = getattr(opt, f"lr_warmup_{unit}")
    decay = getattr(opt, f"lr_decay_{unit}") or length
    if opt.lr_warmup_fraction is not None:
        if warmup:
            raise ConfigError(f"give either --lr-warmup-fraction or --lr-warmup-{unit}, not both")
        return
    if warmup and warmup >= decay:
        raise ConfigError(f"--lr-warmup-{unit} {warmup} must be shorter than the decay length "
                          f"{decay} (--lr-decay-{unit} or --train-{unit}); shorten the warm-up")


@dataclass
class RunConfig:
    """Everything one training run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        check_schedule_units(self.optimizer, self.training)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        """Inverse of :meth:`to_dict`; unknown keys are an error."""
        parts = {}
        for f in fields(cls):
            sub = data.get(f.name, {})
            sub_cls = {"model": ModelConfig, "data": DataConfig, "optimizer": OptimizerConfig,
                       "training": TrainingConfig, "parallel": ParallelConfig}[f.name]
            known = {g.name for g in fields(sub_cls)}
            unknown = set(sub) - known
            if unknown:
                raise ConfigError(f"unknown {f.name} config keys: {', '.join(sorted(unknown))}")
            parts[f.name] = sub_cls(**sub)
        return cls(**parts)
