"""Typed configuration for a training run, and the one description of the model.

Each dataclass validates its own fields in ``__post_init__`` and raises
:class:`~megatron_h2.errors.ConfigError` with one line that says what to fix. The command line
(``megatron_h2/training/arguments.py``) only maps Megatron-style flags onto these classes.

:class:`ModelConfig` is what both the runtime builds (``megatron_h2.models``) and the planner
plans for (``megatron_h2.planner``): its parameter counts, FLOPs, vocabulary padding
(:func:`pad_vocab_size`), activation bytes and :func:`state_bytes_per_param` are the only ones in
the project.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from megatron_h2.errors import ConfigError

Recompute = Literal["none", "selective", "full"]
RECOMPUTE_MODES: tuple[Recompute, ...] = ("none", "selective", "full")
"""Activation recompute modes, fastest (and most memory-hungry) first."""
LR_DECAY_STYLES = ("cosine", "linear", "constant")


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

    num_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 8
    num_query_groups: int | None = None  # None: one group per head (plain multi-head attention)
    ffn_hidden_size: int | None = None  # None: swiglu_ffn_size(hidden_size)
    seq_length: int = 128
    max_position_embeddings: int | None = None  # None: seq_length
    vocab_size: int = 0  # padded vocabulary size; filled in from the tokenizer
    norm_epsilon: float = 1e-5
    rotary_base: float = 10000.0
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    recompute: Recompute = "none"

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
        """Bytes the final norm, output layer and loss keep per micro-batch (bf16 in, fp32 logits)."""
        return tokens * (4 * self.hidden_size + 6 * self.vocab_size / tp)


@dataclass
class DataConfig:
    """Where the tokens come from. An empty ``data_path`` means the embedded default corpus."""

    data_path: list[str] = field(default_factory=list)
    split: str = "949,50,1"
    tokenizer_type: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None  # for NullTokenizer
    make_vocab_size_divisible_by: int = 128
    data_cache_path: str | None = None
    num_workers: int = 0

    def __post_init__(self) -> None:
        _positive(self, "make_vocab_size_divisible_by")
        if self.num_workers < 0:
            raise ConfigError("--num-workers must be >= 0")
        if self.data_path and self.tokenizer_type is None:
            raise ConfigError("--data-path needs --tokenizer-type (and usually --tokenizer-model)")

    def padded_vocab_size(self, vocab_size: int) -> int:
        """The model's vocabulary for a tokenizer of ``vocab_size`` (see :func:`pad_vocab_size`)."""
        return pad_vocab_size(vocab_size, self.make_vocab_size_divisible_by)


@dataclass
class OptimizerConfig:
    """AdamW with warm-up then decay to ``min_lr``."""

    lr: float = 1e-3
    min_lr: float | None = None  # None: lr / 10
    lr_warmup_iters: int = 20
    lr_decay_style: str = "cosine"
    lr_decay_iters: int | None = None  # None: train_iters
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0

    def __post_init__(self) -> None:
        _positive(self, "lr")
        if self.min_lr is None:
            self.min_lr = self.lr / 10
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

    micro_batch_size: int = 4
    global_batch_size: int = 8
    train_iters: int = 200
    seed: int = 1234
    bf16: bool = False
    device: str | None = None  # None: detect at start-up
    log_interval: int = 10
    eval_interval: int = 100
    eval_iters: int = 5
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    tensorboard_dir: str | None = None
    log_jsonl: str | None = None
    timeline_trace: str | None = None  # Chrome / Perfetto trace of every rank's schedule
    exit_interval: int | None = None  # stop (after saving) once iteration % exit_interval == 0

    def __post_init__(self) -> None:
        _positive(self, "micro_batch_size", "global_batch_size", "train_iters", "log_interval",
                  "eval_interval")
        if self.eval_iters < 0:
            raise ConfigError("--eval-iters must be >= 0 (0 disables evaluation)")
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"--global-batch-size {self.global_batch_size} is not divisible by "
                f"--micro-batch-size {self.micro_batch_size}; make it a multiple")
        if self.save_interval is not None and self.save_interval <= 0:
            raise ConfigError("--save-interval must be a positive number of iterations")
        if self.exit_interval is not None and self.exit_interval <= 0:
            raise ConfigError("--exit-interval must be a positive number of iterations")

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // self.micro_batch_size


@dataclass
class ParallelConfig:
    """Uniform tensor / pipeline / data parallelism (Megatron's flags). DP is what remains of the
    world size after TP x PP. A heterogeneous plan file replaces the TP / PP fields."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    # one layer count per stage ([3, 1]), or per model chunk one list with a count per stage
    # ([[2, 1], [1, 2]] for --pipeline-layer-split 2,1/1,2: chunk 0 = 2 + 1, chunk 1 = 1 + 2)
    pipeline_layer_split: list[int] | list[list[int]] | None = None
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    distributed_timeout_minutes: float = 10.0
    ddp_bucket_size_mb: float = 25.0
    hetero_plan: str | None = None  # YAML plan: stages on chip types, each with its own TP
    force_bridge: bool = False  # route every stage boundary through the host-staged bridge
    bridge_dtype: str = "fp32"  # what crosses the bridge: fp32 or bf16
    bridge_chunk_mb: float = 4.0
    # Virtual pipeline stages (Megatron's interleaving): model chunks per stage, or layers per
    # chunk (V = layers / PP / N); at most one of the two.
    virtual_pipeline_model_parallel_size: int | None = None
    num_layers_per_virtual_pipeline_stage: int | None = None
    # 1f1b | interleaved | zero-bubble; None: interleaved with virtual stages, else 1f1b
    pipeline_schedule: str | None = None

    def __post_init__(self) -> None:
        _positive(self, "tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "distributed_timeout_minutes", "ddp_bucket_size_mb", "bridge_chunk_mb")
        if self.bridge_dtype not in ("fp32", "bf16"):
            raise ConfigError(f"--bridge-dtype must be fp32 or bf16, got {self.bridge_dtype!r}")
        if self.pipeline_layer_split is not None:
            self._check_split()
        for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0")
        self._check_virtual()

    @property
    def _per_chunk_split(self) -> list[list[int]] | None:
        split = self.pipeline_layer_split
        if split and isinstance(split[0], (list, tuple)):
            return [list(chunk) for chunk in split]
        return None

    def _check_split(self) -> None:
        pp = self.pipeline_model_parallel_size
        chunks = self._per_chunk_split or [self.pipeline_layer_split]
        for c, counts in enumerate(chunks):
            if len(counts) != pp:
                where = f" in chunk {c}" if len(chunks) > 1 else ""
                raise ConfigError(
                    f"--pipeline-layer-split has {len(counts)} counts{where} but "
                    f"--pipeline-model-parallel-size is {pp}; give one layer count per stage "
                    "(stages separated by ',', model chunks by '/')")
            if any(n < 0 for n in counts):
                raise ConfigError("--pipeline-layer-split counts must be >= 0")
        if (self.decoder_first_pipeline_num_layers is not None
                or self.decoder_last_pipeline_num_layers is not None):
            raise ConfigError("use either --pipeline-layer-split or --decoder-first/last-"
                              "pipeline-num-layers, not both")

    def _check_virtual(self) -> None:
        v, n = self.virtual_pipeline_model_parallel_size, self.num_layers_per_virtual_pipeline_stage
        for name, value in (("virtual_pipeline_model_parallel_size", v),
                            ("num_layers_per_virtual_pipeline_stage", n)):
            if value is not None and value <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive number, "
                                  f"got {value}")
        if v is not None and n is not None:
            raise ConfigError("give either --virtual-pipeline-model-parallel-size or "
                              "--num-layers-per-virtual-pipeline-stage, not both")
        if n is not None and (self.pipeline_layer_split is not None
                              or self.decoder_first_pipeline_num_layers is not None
                              or self.decoder_last_pipeline_num_layers is not None):
            raise ConfigError("--num-layers-per-virtual-pipeline-stage splits the layers evenly; "
                              "for an uneven split use --pipeline-layer-split with per-chunk "
                              "counts (e.g. 2,1/1,2) instead")
        split = self._per_chunk_split
        if split is not None and v is not None and v != len(split):
            raise ConfigError(f"--pipeline-layer-split gives {len(split)} model chunks but "
                              f"--virtual-pipeline-model-parallel-size is {v}")
        if self.pipeline_schedule not in (None, "1f1b", "interleaved", "zero-bubble"):
            raise ConfigError(f"--pipeline-schedule must be 1f1b, interleaved or zero-bubble, "
                              f"got {self.pipeline_schedule!r}")

    def chunk_layers(self, num_layers: int) -> list[list[int]]:
        """``[stage][chunk]``: layers of every model chunk of every stage (one chunk per stage
        without virtual stages); counts that do not add up are an error."""
        pp, split = self.pipeline_model_parallel_size, self._per_chunk_split
        if split is not None:
            total = sum(map(sum, split))
            if total != num_layers:
                text = "/".join(",".join(map(str, chunk)) for chunk in split)
                raise ConfigError(f"--pipeline-layer-split {text} adds up to {total} layers but "
                                  f"--num-layers is {num_layers}")
            return [[chunk[s] for chunk in split] for s in range(pp)]
        n = self.num_layers_per_virtual_pipeline_stage
        if n is not None:
            if num_layers % pp:
                raise ConfigError(f"--num-layers-per-virtual-pipeline-stage needs --num-layers "
                                  f"{num_layers} divisible by --pipeline-model-parallel-size {pp}")
            if (num_layers // pp) % n:
                raise ConfigError(f"the {num_layers // pp} layers of each pipeline stage are not "
                                  f"divisible by --num-layers-per-virtual-pipeline-stage {n}")
            return [[n] * (num_layers // pp // n) for _ in range(pp)]
        v = self.virtual_pipeline_model_parallel_size or 1
        counts = self.stage_layers(num_layers)
        for stage, count in enumerate(counts):
            if count % v:
                raise ConfigError(
                    f"stage {stage} has {count} layers, which do not split into "
                    f"--virtual-pipeline-model-parallel-size {v} equal chunks; give per-chunk "
                    "counts with --pipeline-layer-split (e.g. 2,1/1,2)")
        return [[count // v] * v for count in counts]

    def stage_layers(self, num_layers: int) -> list[int]:
        """Layer count of every pipeline stage; counts that do not add up are an error."""
        pp = self.pipeline_model_parallel_size
        if self._per_chunk_split is not None:
            return [sum(chunks) for chunks in self.chunk_layers(num_layers)]
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
