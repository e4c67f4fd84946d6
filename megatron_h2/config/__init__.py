"""Typed configuration for a training run, and the one description of the model.

Each dataclass validates its own fields in ``__post_init__`` and raises
:class:`~megatron_h2.errors.ConfigError` with one line that says what to fix. A field declared
with :func:`flag` is a command-line flag: ``megatron_h2/training/arguments.py`` generates the
parser from these declarations (name, help, choices), so the defaults here are the command
line's, and they are Megatron-LM's wherever Megatron has the flag.

:class:`ModelConfig` is what both the runtime builds (``megatron_h2.models``) and the planner
plans for (``megatron_h2.planner``): its parameter counts, FLOPs and activation bytes (from its
base :class:`~megatron_h2.config.model_counts.ModelCounts`), the vocabulary padding
(:func:`pad_vocab_size`) and :func:`state_bytes_per_param` are the only ones in the project.

Modules: :mod:`.flags` (flag fields and shared parsers), :mod:`.model_config`, :mod:`.data`,
:mod:`.moe_config` (the mixture-of-experts fields of the model), :mod:`.optimizer`,
:mod:`.training`, :mod:`.dtype_rules` (:class:`Precision`, the dtypes of the
model state and its bytes per parameter), :mod:`.parallel`, :mod:`.logging_config`, :mod:`.run`
(:class:`RunConfig`), :mod:`.megatron_flags` (the Megatron-LM flags accepted without effect or
refused, with the reason).
"""

from megatron_h2.config.data import (  # noqa: F401
    LEGACY_SPLIT,
    MOCK_SPLIT,
    TOKENIZER_TYPES,
    DataConfig,
)
from megatron_h2.config.dtype_rules import (  # noqa: F401
    DTYPE_BYTES,
    MEGATRON_BF16,
    Precision,
    state_bytes_per_param,
)
from megatron_h2.config.flags import (  # noqa: F401
    _SUFFIXES,
    _count,
    _positive,
    _required,
    cli_fields,
    flag,
    flag_name,
    layer_split,
    parse_batch_size_schedule,
)
from megatron_h2.config.logging_config import (  # noqa: F401
    TIMING_LOG_OPTIONS,
    LoggingConfig,
)
from megatron_h2.config.model_config import (  # noqa: F401
    ARCHITECTURE_FIELDS,
    ATTENTION_BACKENDS,
    LLAMA_ARCHITECTURE,
    NORMALIZATIONS,
    POSITION_EMBEDDING_TYPES,
    RECOMPUTE_METHODS,
    TRANSFORMER_IMPLS,
    Activation,
    ModelConfig,
    pad_vocab_size,
    swiglu_ffn_size,
)
from megatron_h2.config.model_counts import (  # noqa: F401
    RECOMPUTE_MODES,
    ModelCounts,
    Recompute,
)
from megatron_h2.config.moe_config import (  # noqa: F401
    MoEFields,
    parse_moe_layer_freq,
)
from megatron_h2.config.optimizer import (  # noqa: F401
    LR_DECAY_STYLES,
    WD_INCR_STYLES,
    WSD_DECAY_STYLES,
    OptimizerConfig,
)
from megatron_h2.config.parallel import (  # noqa: F401
    ParallelConfig,
)
from megatron_h2.config.run import (  # noqa: F401
    RunConfig,
    check_schedule_units,
)
from megatron_h2.config.training import (  # noqa: F401
    TrainingConfig,
)
