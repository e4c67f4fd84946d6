"""Everything one training run needs (:class:`RunConfig`), and checks across its parts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from megatron_h2.config.data import DataConfig
from megatron_h2.config.logging_config import LoggingConfig
from megatron_h2.config.model_config import ModelConfig
from megatron_h2.config.optimizer import OptimizerConfig
from megatron_h2.config.parallel import ParallelConfig
from megatron_h2.config.training import TrainingConfig
from megatron_h2.errors import ConfigError


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
    logging: LoggingConfig = field(default_factory=LoggingConfig)

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
                       "training": TrainingConfig, "parallel": ParallelConfig,
                       "logging": LoggingConfig}[f.name]
            known = {g.name for g in fields(sub_cls)}
            unknown = set(sub) - known
            if unknown:
                raise ConfigError(f"unknown {f.name} config keys: {', '.join(sorted(unknown))}")
            parts[f.name] = sub_cls(**sub)
        return cls(**parts)
