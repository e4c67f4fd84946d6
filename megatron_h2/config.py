"""Typed configuration for a training run.

Each dataclass validates its own fields in ``__post_init__`` and raises
:class:`~megatron_h2.errors.ConfigError` with one line that says what to fix. The command line
(``megatron_h2/training/arguments.py``) only maps Megatron-style flags onto these classes.
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
        """Round up to a multiple of ``make_vocab_size_divisible_by``.

        Unlike Megatron the TP degree is not folded in, so the model (and its checkpoints) is
        the same under every layout; TP must divide the result.
        """
        multiple = self.make_vocab_size_divisible_by
        return -(-vocab_size // multiple) * multiple


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
    # Checkpoint integrity and retention (--save-retain-interval as in Megatron)
    verify_checkpoint: bool = True  # check every part's checksum on load (--no-verify-checkpoint)
    save_retain_interval: int | None = None  # keep the newest and every multiple of this only
    most_recent_k: int = -1  # also keep the K newest checkpoints; -1 keeps all
    # Numerical health (Megatron's --no-check-for-nan-in-loss-and-grad, --check-for-spiky-loss)
    check_for_nan_in_loss_and_grad: bool = True  # NaN / Inf found before the optimizer step
    check_for_spiky_loss: bool = False  # a loss above spiky_loss_factor x the running median
    spiky_loss_factor: float = 10.0
    flat_line_iters: int = 5  # grad norm 0 or loss at ln(vocab) this many iterations; 0: off
    skip_bad_steps: int = 0  # skip up to this many bad steps (no update), then stop

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
        self._check_health_and_retention()

    def _check_health_and_retention(self) -> None:
        if self.save_retain_interval is not None:
            if self.save_retain_interval <= 0:
                raise ConfigError("--save-retain-interval must be a positive number of iterations")
            if self.save_interval and self.save_retain_interval % self.save_interval:
                raise ConfigError(f"--save-retain-interval {self.save_retain_interval} must be a "
                                  f"multiple of --save-interval {self.save_interval}")
        if self.most_recent_k == 0 or self.most_recent_k < -1:
            raise ConfigError("--most-recent-k must be a positive count, or -1 to keep all")
        if not self.spiky_loss_factor > 1.0:
            raise ConfigError(f"--spiky-loss-factor must be above 1, got {self.spiky_loss_factor}")
        if self.flat_line_iters < 0 or self.skip_bad_steps < 0:
            raise ConfigError("--flat-line-iters and --skip-bad-steps must be >= 0")

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // self.micro_batch_size


@dataclass
class ParallelConfig:
    """Uniform tensor / pipeline / data parallelism (Megatron's flags). DP is what remains of the
    world size after TP x PP. A heterogeneous plan file replaces the TP / PP fields."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    pipeline_layer_split: list[int] | None = None  # one layer count per stage
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

    def __post_init__(self) -> None:
        _positive(self, "tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "distributed_timeout_minutes", "ddp_bucket_size_mb", "bridge_chunk_mb")
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
