"""Typed configuration for a training run, and the one description of the model.

Each dataclass validates its own fields in ``__post_init__`` and raises
:class:`~megatron_h2.errors.ConfigError` with one line that says what to fix. A field declared
with :func:`flag` is a command-line flag: ``megatron_h2/training/arguments.py`` generates the
parser from these declarations (name, help, choices), so the defaults here are the command
line's, and they are Megatron-LM's wherever Megatron has the flag.

:class:`ModelConfig` is what both the runtime builds (``megatron_h2.models``) and the planner
plans for (``megatron_h2.planner``): its parameter counts, FLOPs, vocabulary padding
(:func:`pad_vocab_size`), activation bytes and :func:`state_bytes_per_param` are the only ones in
the project.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from megatron_h2.errors import ConfigError

Recompute = Literal["none", "selective", "full"]
RECOMPUTE_MODES: tuple[Recompute, ...] = ("none", "selective", "full")
"""Activation recompute modes, fastest (and most memory-hungry) first."""
LR_DECAY_STYLES = ("cosine", "linear", "constant")


def flag(default: Any = None, help: str = "", *, name: str | None = None,
         choices: tuple | None = None, negative: bool = False, required: bool = False,
         parse: Callable[[str], Any] | None = None, metavar: str | None = None,
         shortcuts: tuple[tuple[str, Any, str], ...] = ()) -> Any:
    """A dataclass field that is also a command-line flag.

    ``name`` overrides the flag (default ``--field-name``); ``negative`` makes a bool flag that
    sets the field to False (Megatron's ``--disable-...`` / ``--no-...`` flags); ``required``
    flags must be given unless the run is the embedded demo; ``parse`` converts the text;
    ``shortcuts`` are extra flags ``(flag, value, help)`` that set the field to a fixed value.
    """
    meta = {"help": help, "name": name, "choices": choices, "negative": negative,
            "required": required, "parse": parse, "metavar": metavar, "shortcuts": shortcuts}
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
    return max(64, int(4 * hidden_size * 2 / 3) // 64 * 64)


@dataclass
class ModelConfig:
    """Shape of a LLaMA-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention)."""

    # The shape flags are required on the command line (as in Megatron) except for the embedded
    # demo, which uses these defaults.
    num_layers: int = flag(4, "Number of transformer layers.", required=True)
    hidden_size: int = flag(256, "Transformer hidden size.", required=True)
    num_attention_heads: int = flag(8, "Number of transformer attention heads.", required=True)
    num_query_groups: int | None = flag(
        None, "Number of query groups (key/value heads) for grouped-query attention; default: "
        "one per head.")
    ffn_hidden_size: int | None = flag(
        None, "Transformer feed-forward network hidden size; default: Megatron's SwiGLU size "
        "(2/3 of 4h, rounded down to a multiple of 64).")
    seq_length: int = flag(128, "Maximum sequence length to process.", required=True)
    max_position_embeddings: int | None = flag(
        None, "Maximum number of position embeddings; default: --seq-length.")
    norm_epsilon: float = flag(1e-5, "Epsilon for layer norm and RMS norm.")
    rotary_base: float = flag(10000.0, "Base to use for rotary positional embeddings.")
    init_method_std: float = flag(
        0.02, "Standard deviation of the zero mean normal distribution used for weight "
        "initialization.")
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
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = swiglu_ffn_size(self.hidden_size)
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        _positive(self, "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                  "ffn_hidden_size", "seq_length", "max_position_embeddings")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                f"{self.num_attention_heads}; choose a hidden size that is a multiple of the heads")
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(
                f"--num-query-groups {self.num_query_groups} does not divide --num-attention-heads "
                f"{self.num_attention_heads}; use a divisor of the head count")
        if self.kv_channels % 2:
            raise ConfigError(f"head dimension {self.kv_channels} (hidden/heads) must be even "
                              "for rotary embeddings")
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

    @property
    def kv_channels(self) -> int:
        """Dimension of one attention head."""
        return self.hidden_size // self.num_attention_heads

    # ------------------------------------------------------------------ parameters and FLOPs
    # Counted for the architecture the runtime builds (megatron_h2.models.gpt), on the padded
    # vocabulary: ``vocab_size`` is the size of the embedding and output layer.
    @property
    def kv_size(self) -> int:
        """Width of the K (and of the V) projection: query groups x head dimension."""
        return self.num_query_groups * self.kv_channels

    @property
    def layer_matrix_params(self) -> int:
        """Weights of one layer's matrices: fused QKV, output projection, SwiGLU [gate|up], down."""
        h = self.hidden_size
        return h * (self.num_attention_heads * self.kv_channels + 2 * self.kv_size) \
            + self.num_attention_heads * self.kv_channels * h + 3 * h * self.ffn_hidden_size

    @property
    def layer_params(self) -> int:
        """All parameters of one layer (matrices and the two norm scales)."""
        return self.layer_matrix_params + 2 * self.hidden_size

    def layer_params_per_chip(self, tp: int) -> float:
        """Parameters of one layer on one TP rank (matrices split, norm scales replicated)."""
        return self.layer_matrix_params / tp + 2 * self.hidden_size

    def embedding_params_per_chip(self, tp: int) -> float:
        """Vocabulary-parallel input embedding on one TP rank."""
        return self.vocab_size * self.hidden_size / tp

    def head_params_per_chip(self, tp: int) -> float:
        """Final norm plus vocabulary-parallel output layer on one TP rank."""
        return self.vocab_size * self.hidden_size / tp + self.hidden_size

    def num_parameters(self) -> int:
        """Parameters of the whole model (layers, embedding, final norm, output layer)."""
        return self.num_layers * self.layer_params + 2 * self.vocab_size * self.hidden_size \
            + self.hidden_size

    def attention_core_flops_per_token(self, causal: bool = True) -> float:
        """QK^T and AV of one layer per token: 4 x seq x (heads x head dim) over the full square,
        half of it with the causal mask (the work a chip does)."""
        full = 4.0 * self.seq_length * self.num_attention_heads * self.kv_channels
        return full / 2 if causal else full

    def layer_forward_flops(self, tokens: int, causal: bool = True) -> float:
        """Forward FLOPs of one layer over ``tokens`` tokens (matrix multiplies + attention)."""
        return tokens * (2.0 * self.layer_matrix_params
                         + self.attention_core_flops_per_token(causal))

    def head_forward_flops(self, tokens: int) -> float:
        """Forward FLOPs of the output layer (logits over the padded vocabulary)."""
        return tokens * 2.0 * self.hidden_size * self.vocab_size

    def layer_weight_grad_flops(self, tokens: int) -> float:
        """FLOPs of one layer's weight gradients (``dW = X^T dY`` of its four matrices): the part
        of the backward (2 x forward) that a zero-bubble schedule defers. The rest, the input
        gradients and the attention core's backward, is what the previous stage waits for."""
        return tokens * 2.0 * self.layer_matrix_params

    def head_weight_grad_flops(self, tokens: int) -> float:
        """FLOPs of the output layer's weight gradient (half of its backward)."""
        return self.head_forward_flops(tokens)

    def flops_per_token(self, causal: bool = False) -> float:
        """Training FLOPs of one token, forward + backward = 3 x forward, no recompute.

        ``causal=False`` counts attention over the full square, as Megatron's model-TFLOP/s
        accounting does (the runtime's log line); the planner's MFU counts the causal half.
        """
        forward = self.num_layers * self.layer_forward_flops(1, causal) \
            + self.head_forward_flops(1)
        return 3.0 * forward

    # ----------------------------------------------------------------------------- memory
    def layer_activation_bytes(self, tokens: int, tp: int, recompute: Recompute) -> float:
        """Bytes one layer keeps for backward per micro-batch of ``tokens`` tokens (bf16).

        ``none``: the inputs of every matrix multiply, the norms, the attention core and the
        SwiGLU activation; ``selective``: the attention core and the activation are recomputed;
        ``full``: only the layer input is kept. Sharded parts are divided by TP.
        """
        h, f, kv, a = (self.hidden_size, self.ffn_hidden_size, self.kv_size,
                       self.num_attention_heads)
        if recompute == "none":
            return tokens * (8 * h + (4 * h + 4 * kv + 6 * f + 4 * a) / tp)
        if recompute == "selective":
            return tokens * (4 * h + (2 * h + 4 * kv + 4 * f) / tp)
        return tokens * 2.0 * h

    def head_activation_bytes(self, tokens: int, tp: int) -> float:
        """Bytes the final norm, output layer and loss keep per micro-batch (bf16 input, fp32
        logits)."""
        return tokens * (4 * self.hidden_size + 6 * self.vocab_size / tp)

    def layer_weight_grad_bytes(self, tokens: int, tp: int) -> float:
        """Bytes one layer keeps per micro-batch between its input gradient and its deferred
        weight gradient (zero-bubble): every matrix's input and output gradient, bf16, per TP
        rank (QKV: h in, (h + 2 kv) / t out; projection: h / t in, h out; gate|up: h in,
        2 f / t out; down: f / t in, h out)."""
        h, f, kv = self.hidden_size, self.ffn_hidden_size, self.kv_size
        return tokens * (8 * h + (4 * h + 4 * kv + 6 * f) / tp)

    def head_weight_grad_bytes(self, tokens: int, tp: int) -> float:
        """The same for the output layer: its input (h) and the logits' gradient (V / t), bf16."""
        return tokens * 2.0 * (self.hidden_size + self.vocab_size / tp)

    def embedding_weight_grad_bytes(self, tokens: int) -> float:
        """The same for the input embedding: the gradient of its output (h, bf16)."""
        return tokens * 2.0 * self.hidden_size


@dataclass
class DataConfig:
    """Where the tokens come from. An empty ``data_path`` means the embedded default corpus."""

    data_path: list[str] = flag(
        [], "PREFIX [PREFIX ...] or W1 PREFIX1 W2 PREFIX2 ... of Megatron .bin/.idx files; "
        "default: the embedded demo corpus built from the Python standard library.",
        metavar="PATH")
    split: str = flag("969, 30, 1", "Comma-separated proportions for training, validation and "
                      "test documents.")
    tokenizer_type: str | None = flag(None, "What type of tokenizer to use.")
    tokenizer_model: str | None = flag(None, "Tokenizer model file or directory.")
    vocab_size: int | None = flag(None, "Size of the vocabulary without padding (NullTokenizer).")
    make_vocab_size_divisible_by: int = flag(
        128, "Pad the vocabulary to be divisible by this value (not multiplied by the TP size, "
        "so every layout builds the same model).")
    data_cache_path: str | None = flag(None, "Directory to hold cached index files.")

    def __post_init__(self) -> None:
        _positive(self, "make_vocab_size_divisible_by")
        if self.data_path and self.tokenizer_type is None:
            raise ConfigError("--data-path needs --tokenizer-type (and usually --tokenizer-model)")

    def padded_vocab_size(self, vocab_size: int) -> int:
        """The model's vocabulary for a tokenizer of ``vocab_size`` (see :func:`pad_vocab_size`)."""
        return pad_vocab_size(vocab_size, self.make_vocab_size_divisible_by)


@dataclass
class OptimizerConfig:
    """AdamW with warm-up then decay to ``min_lr``."""

    optimizer: str = flag("adam", "Optimizer function (Adam with decoupled weight decay).",
                          choices=("adam",))
    lr: float = flag(1e-3, "Initial learning rate (the peak after warm-up).", required=True)
    min_lr: float = flag(0.0, "Minimum value for learning rate.")
    lr_warmup_iters: int = flag(0, "Number of iterations to linearly warm up the learning rate.")
    lr_decay_style: str = flag("linear", "Learning rate decay function.", choices=LR_DECAY_STYLES)
    lr_decay_iters: int | None = flag(None, "Iterations to decay the learning rate over; "
                                      "default: --train-iters.")
    weight_decay: float = flag(0.01, "Weight decay coefficient for L2 regularization.")
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
        if self.lr_warmup_iters < 0:
            raise ConfigError("--lr-warmup-iters must be >= 0")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ConfigError(f"--lr-decay-style must be one of {', '.join(LR_DECAY_STYLES)}, "
                              f"got {self.lr_decay_style!r}")
        if self.weight_decay < 0 or self.clip_grad < 0:
            raise ConfigError("--weight-decay and --clip-grad must be >= 0 (0 disables clipping)")


@dataclass
class TrainingConfig:
    """Batching, length of the run, precision, logging and checkpoint cadence."""

    micro_batch_size: int = flag(4, "Batch size per model instance (local batch size).",
                                 required=True)
    global_batch_size: int | None = flag(
        None, "Training batch size; default: --micro-batch-size x data-parallel size.")
    train_iters: int = flag(200, "Total number of iterations to train over all training runs.",
                            required=True)
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

    def __post_init__(self) -> None:
        _required(self, "micro_batch_size", "train_iters")
        if self.fp16:
            raise ConfigError("--fp16 is not supported; use --bf16 (fp32 master weights, no loss "
                              "scaling needed)")
        _positive(self, "micro_batch_size", "train_iters", "log_interval", "eval_interval")
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


@dataclass
class RunConfig:
    """Everything one training run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        decay = self.optimizer.lr_decay_iters or self.training.train_iters
        if self.optimizer.lr_warmup_iters > decay:
            raise ConfigError(f"--lr-warmup-iters {self.optimizer.lr_warmup_iters} exceeds the "
                              f"decay length {decay} (--lr-decay-iters or --train-iters); "
                              "shorten the warm-up")

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
