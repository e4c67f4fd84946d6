"""The command line of ``pretrain_gpt.py``, generated from the typed configs.

Every flag is a field of a config dataclass declared with :func:`megatron_h2.config.flag`
(name, help, choices, default), so ``--help`` shows each flag's meaning and default and there is
no second list of flags. Flags that Megatron-LM scripts pass but that change nothing here are
listed once in :data:`megatron_h2.config.megatron_flags.COMPAT_FLAGS` (with those refused) and
reported at start-up. Abbreviated flags are not
accepted (``--num-layer`` is an error, as is any unknown flag, in one line naming the closest
known flag).
"""

from __future__ import annotations

import argparse
import difflib
import types
import typing
from dataclasses import dataclass, fields
from typing import Any

from megatron_h2.config import (
    ARCHITECTURE_FIELDS,
    LLAMA_ARCHITECTURE,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RunConfig,
    TrainingConfig,
    cli_fields,
    flag,
    flag_name,
)
from megatron_h2.config.flags import bounded_int, finite_float
from megatron_h2.config.megatron_flags import COMPAT_FLAGS, unsupported_reason
from megatron_h2.config.moe_config import MoEFields
from megatron_h2.errors import ConfigError


@dataclass
class LaunchOptions:
    """Options that shape this launch but are not part of the saved run config."""

    ckpt_step: int | None = flag(None, "Load this iteration instead of the latest.")
    no_load_optim: bool = flag(False, "Do not load the optimizer state when loading a checkpoint.")
    no_load_rng: bool = flag(False, "Do not load the RNG states when loading a checkpoint.")
    finetune: bool = flag(False, "Load model weights only and start at iteration 0.")
    ckpt_format: str | None = flag(
        None, "Megatron-LM checkpoint format: the one --load holds (torch_dist, or the legacy "
        "torch; default: whatever the directory holds; megatron_h2 checkpoints load whatever "
        "this says) and, with torch_dist, the format --save writes (default: megatron_h2's own, "
        "with checksums and RNG states).", choices=("torch", "torch_dist"))
    auto_detect_ckpt_format: bool = flag(
        False, "Load a Megatron-LM checkpoint of either format, whatever --ckpt-format says.")
    use_checkpoint_args: bool = flag(
        False, "Override the model flags (shape and architecture) with those of the --load "
        "checkpoint (megatron_h2's or Megatron-LM's).")
    explicit: frozenset[str] = frozenset()  # config fields the user set on the command line
    no_effect: tuple[str, ...] = ()  # compatibility flags given (reported at start-up)
    demo_flags: tuple[str, ...] = ()  # what the embedded demo set that the user did not


GROUPS: tuple[tuple[str, type], ...] = (
    ("model", ModelConfig),
    ("data", DataConfig),
    ("optimizer", OptimizerConfig),
    ("training", TrainingConfig),
    ("parallelism (DP = world size / (TP x PP))", ParallelConfig),
    ("logging, timers and profiling", LoggingConfig),
    ("checkpoint loading", LaunchOptions),
)

class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(message)


def _base_type(annotation: Any) -> Any:
    """``int | None`` -> int; ``list[int] | None`` -> list[int]."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0]
    return annotation


def _add_field(group: argparse._ArgumentGroup, cls: type, f, hint: Any) -> None:
    meta = f.metadata["cli"]
    dest = f"{cls.__name__}.{f.name}"
    default = f.default_factory() if callable(f.default_factory) else f.default
    text = meta["help"]
    if meta["required"]:
        alternatives = " or ".join(flag_name(g) for g in fields(cls) if g.name in meta["unless"])
        text += f" (required, or {alternatives})" if alternatives else " (required)"
    elif "default:" not in text:
        text += f" (default: {default!r})"
    kind = _base_type(hint)
    common = {"dest": dest, "default": argparse.SUPPRESS, "help": text}
    if kind is bool:
        action = "store_false" if meta["negative"] else "store_true"
        group.add_argument(flag_name(f), *meta["aliases"], action=action, **common)
    else:
        if typing.get_origin(kind) is list and meta["parse"] is None:
            item = typing.get_args(kind)[0]
            common["nargs"] = meta["nargs"] or "+"
            kind = item
        if typing.get_origin(kind) is typing.Literal:
            kind = str
        parse = meta["parse"] or _NUMBER_PARSERS.get(kind, kind)
        group.add_argument(flag_name(f), *meta["aliases"], type=_converter(parse),
                           choices=meta["choices"],
                           metavar=None if meta["choices"] else (meta["metavar"] or f.name.upper()),
                           **common)
    for name, value, help_text in meta["shortcuts"]:
        group.add_argument(name, action="store_const", const=value, dest=dest,
                           default=argparse.SUPPRESS, help=help_text)


_NUMBER_PARSERS = {float: finite_float, int: bounded_int}


def _converter(parse):
    def convert(text: str):
        try:
            return parse(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        except ValueError:
            kind = getattr(parse, "__name__", "value")
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def build_parser() -> argparse.ArgumentParser:
    """The ``pretrain_gpt.py`` parser, one argument group per config dataclass."""
    p = _Parser(prog="pretrain_gpt.py", allow_abbrev=False,
                description="Megatron-style GPT pretraining (megatron_h2). With no flags, "
                            "trains a small model on an embedded corpus.")
    moe_fields = {f.name for f in fields(MoEFields)}
    for title, cls in GROUPS:
        group = p.add_argument_group(title)
        moe = p.add_argument_group("mixture of experts") if cls is ModelConfig else None
        hints = typing.get_type_hints(cls)
        for f in cli_fields(cls):
            _add_field(moe if moe and f.name in moe_fields else group, cls, f, hints[f.name])
    compat = p.add_argument_group("accepted for Megatron compatibility, without effect")
    for name, entry in COMPAT_FLAGS.items():
        kwargs: dict[str, Any] = {"action": "store_true"}
        if entry.takes_value:
            kwargs = {"metavar": None if entry.choices else "VALUE", "choices": entry.choices,
                      "nargs": entry.nargs}
        compat.add_argument(name, dest=f"compat.{name}", default=argparse.SUPPRESS,
                            help=entry.reason, **kwargs)
    return p


def add_config_flags(group: argparse._ArgumentGroup, cls: type, names: tuple[str, ...]) -> None:
    """Add the flags of the fields ``names`` of config class ``cls`` to ``group``, for tools
    that share flags with ``pretrain_gpt.py``; read them back with :func:`config_values`."""
    hints = typing.get_type_hints(cls)
    for f in cli_fields(cls):
        if f.name in names:
            _add_field(group, cls, f, hints[f.name])


def config_values(ns: argparse.Namespace, cls: type) -> dict[str, Any]:
    """``{field: value}`` of the flags of ``cls`` given on a command line parsed with
    :func:`add_config_flags`."""
    prefix = f"{cls.__name__}."
    return {k[len(prefix):]: v for k, v in vars(ns).items() if k.startswith(prefix)}


def _known_flags(parser: argparse.ArgumentParser) -> list[str]:
    return [s for action in parser._actions for s in action.option_strings]


def parse_flags(argv: list[str] | None) -> tuple[dict[str, dict[str, Any]], tuple[str, ...]]:
    """``{class name: {field: value}}`` of the flags given, and the compatibility flags given."""
    parser = build_parser()
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        bad = next((u for u in unknown if u.startswith("-")), unknown[0])
        name = bad.split("=", 1)[0]
        reason = unsupported_reason(name)
        if reason is not None:
            raise ConfigError(f"{name} is not supported: {reason}")
        close = difflib.get_close_matches(name, _known_flags(parser), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else "; see pretrain_gpt.py --help"
        what = "unknown flag" if name.startswith("-") else "unexpected value"
        raise ConfigError(f"{what} {name}{hint}")
    given: dict[str, dict[str, Any]] = {cls.__name__: {} for _, cls in GROUPS}
    compat = []
    for dest, value in vars(ns).items():
        owner, _, name = dest.partition(".")
        if owner == "compat":
            compat.append(name)
        else:
            given[owner][name] = value
    return given, tuple(compat)


# The embedded demo (no --data-path): the required flags take their dataclass defaults, and
# these values replace Megatron's defaults where they suit a small model trained for minutes;
# the model is LLaMA-style.
DEMO_OVERRIDES: dict[str, dict[str, Any]] = {
    "ModelConfig": {**LLAMA_ARCHITECTURE, "hidden_dropout": 0.0, "attention_dropout": 0.0},
    "OptimizerConfig": {"lr_warmup_iters": 20, "lr_decay_style": "cosine", "min_lr": 1e-4,
                        "weight_decay": 0.1, "adam_beta2": 0.95},
    "TrainingConfig": {"global_batch_size": 8, "train_iters": 200, "log_interval": 10,
                       "eval_interval": 100, "eval_iters": 5},
}


# Flags that name the training data; without any of them the run is the embedded demo.
DATA_SOURCES = ("data_path", "mock_data", "train_data_path", "valid_data_path", "test_data_path")


CHECKPOINT_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                   "max_position_embeddings", *ARCHITECTURE_FIELDS)
"""Model fields ``--use-checkpoint-args`` takes from the checkpoint (the vocabulary comes from
the tokenizer and is checked against the checkpoint's)."""


def checkpoint_model_flags(given: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The model fields of the ``--load`` checkpoint, for ``--use-checkpoint-args``."""
    from megatron_h2.checkpointing.format import checkpoint_to_load
    from megatron_h2.checkpointing.megatron_open import read_any_metadata

    load, launch = given["TrainingConfig"].get("load"), given["LaunchOptions"]
    if not load:
        raise ConfigError("--use-checkpoint-args needs --load (the checkpoint to take the model "
                          "flags from)")
    ckpt_dir = checkpoint_to_load(load, launch.get("ckpt_step"))
    if ckpt_dir is None:
        raise ConfigError(f"--use-checkpoint-args: --load directory {load} holds no checkpoint")
    saved = read_any_metadata(ckpt_dir, True, launch.get("ckpt_format"),
                              bool(launch.get("auto_detect_ckpt_format")))
    model = saved.get("config", {}).get("model", {})
    return {name: model[name] for name in CHECKPOINT_ARGS if name in model}


def _check_required(given: dict[str, dict[str, Any]]) -> None:
    plan_owned = {"micro_batch_size"} if given["ParallelConfig"].get("hetero_plan") else set()
    for _, cls in GROUPS:
        for f in cli_fields(cls):
            if f.name in plan_owned:
                continue
            meta = f.metadata["cli"]
            if meta["required"] and f.name not in given[cls.__name__] \
                    and not _alternative_given(f, given):
                alternatives = "".join(f" (or {flag_name(g)})" for g in fields(cls)
                                       if g.name in meta["unless"])
                raise ConfigError(f"{flag_name(f)}{alternatives} is required with --data-path "
                                  "or --mock-data (only the embedded demo, without them, has "
                                  "defaults for it)")


def _alternative_given(f, given: dict[str, dict[str, Any]]) -> bool:
    """Whether a flag that replaces the field ``f`` (its ``unless``) was given."""
    return any(name in mine for mine in given.values() for name in f.metadata["cli"]["unless"])


def _demo_overrides(cls: type, given: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The demo's values for ``cls`` minus those whose alternative flag the user gave."""
    skip = {f.name for f in cli_fields(cls) if _alternative_given(f, given)}
    return {k: v for k, v in DEMO_OVERRIDES.get(cls.__name__, {}).items() if k not in skip}


def as_flag(f, value: Any) -> str:
    """How field ``f`` set to ``value`` is spelled on the command line (a bool flag alone)."""
    if isinstance(value, bool):
        return flag_name(f) if value != f.metadata["cli"]["negative"] else ""
    return f"{flag_name(f)} {value}"


def demo_settings(given: dict[str, dict[str, Any]]) -> list[str]:
    """The flags the embedded demo uses that the user did not give, as ``--flag value``."""
    out = []
    for _, cls in GROUPS:
        overrides = DEMO_OVERRIDES.get(cls.__name__, {})
        for f in cli_fields(cls):
            if f.name in given[cls.__name__] or _alternative_given(f, given):
                continue
            if f.name in overrides:
                out.append(as_flag(f, overrides[f.name]))
            elif f.metadata["cli"]["required"]:
                out.append(as_flag(f, f.default))
    return [x for x in out if x]


def _inert_model_flags(model: ModelConfig, given: dict[str, Any]) -> list[str]:
    """Model flags given that the rest of the flags make ineffective (as in Megatron)."""
    rules = [
        ("num_query_groups", not model.group_query_attention,
         "without --group-query-attention every head has its own key and value"),
        ("add_qkv_bias", model.add_bias_linear, "implied by the biases of every linear layer"),
        ("bias_gelu_fusion", model.activation not in ("gelu", "gelu_tanh") or
         not model.add_bias_linear, "only selects the GeLU of an MLP with biases"),
        ("rope_scaling_factor", not model.use_rope_scaling, "needs --use-rope-scaling"),
    ]
    rotary = "needs --position-embedding-type rope"
    rules += [(name, model.position_embedding_type != "rope", rotary)
              for name in ("rotary_percent", "rotary_base", "rotary_seq_len_interpolation_factor",
                           "use_rope_scaling")]
    by_name = {f.name: f for f in cli_fields(ModelConfig)}
    return [f"{flag_name(by_name[name])} ({why})" for name, inert, why in rules
            if inert and name in given]


def _inert_logging_flags(run: dict[str, Any], given: dict[str, dict[str, Any]]) -> list[str]:
    """Logging and FP8 flags given that the rest of the flags make ineffective (as in Megatron).
    ``run``: the built config parts by class name."""
    logging, training = run["LoggingConfig"], run["TrainingConfig"]
    no_tb = "needs --tensorboard-dir"
    rules = [(LoggingConfig, name, not training.tensorboard_dir, no_tb)
             for name in ("log_timers_to_tensorboard", "log_memory_to_tensorboard",
                          "log_validation_ppl_to_tensorboard", "tensorboard_queue_size")]
    rules += [(LoggingConfig, name, not logging.wandb, "needs --wandb-project")
              for name in ("wandb_exp_name", "wandb_save_dir", "wandb_entity")]
    rules += [(LoggingConfig, name, not logging.profile, "needs --profile")
              for name in ("use_pytorch_profiler", "profile_step_start", "profile_step_end",
                           "profile_ranks")]
    rules += [(ModelConfig, name, run["ModelConfig"].fp8_format is None, "needs --fp8-format")
              for name in ("fp8_recipe", "fp8_margin", "fp8_amax_history_len",
                           "fp8_amax_compute_algo", "fp8_param_gather",
                           "first_last_layers_bf16")]
    out = []
    for cls, name, inert, why in rules:
        if inert and name in given[cls.__name__]:
            f = next(f for f in cli_fields(cls) if f.name == name)
            out.append(f"{flag_name(f)} ({why})")
    return out


def _check_recompute_flags(model: ModelConfig, given: dict[str, Any]) -> None:
    """Megatron asks full recompute for its method and layer count on the command line."""
    if "recompute" in given and model.recompute == "full" and model.recompute_method is None:
        raise ConfigError("--recompute-granularity full needs --recompute-method uniform|block "
                          "and --recompute-num-layers N (as in Megatron; --recompute-method "
                          "uniform --recompute-num-layers 1 recomputes every layer)")


def config_from_args(argv: list[str] | None = None) -> tuple[RunConfig, LaunchOptions]:
    """Parse Megatron-style flags into a validated :class:`RunConfig`."""
    given, compat = parse_flags(argv)
    if given["LaunchOptions"].get("use_checkpoint_args"):
        given["ModelConfig"].update(checkpoint_model_flags(given))
    if any(given["DataConfig"].get(name) for name in DATA_SOURCES):
        _check_required(given)
        values = given
        demo = ()
    else:  # the embedded demo
        values = {cls.__name__: {**_demo_overrides(cls, given), **given[cls.__name__]}
                  for _, cls in GROUPS}
        demo = tuple(demo_settings(given))
    parts = {cls.__name__: cls(**values[cls.__name__]) for _, cls in GROUPS}
    explicit = frozenset(name for mine in given.values() for name in mine)
    launch = parts["LaunchOptions"]
    _check_recompute_flags(parts["ModelConfig"], given["ModelConfig"])
    if "--no-position-embedding" in compat and \
            parts["ModelConfig"].position_embedding_type != "rope":
        raise ConfigError("--no-position-embedding is deprecated, use --position-embedding-type "
                          "(Megatron accepts it only with rotary embeddings)")
    inert = tuple(_inert_model_flags(parts["ModelConfig"], given["ModelConfig"])
                  + _inert_logging_flags(parts, given))
    launch.explicit, launch.no_effect, launch.demo_flags = explicit, compat + inert, demo
    return RunConfig(model=parts["ModelConfig"], data=parts["DataConfig"],
                     optimizer=parts["OptimizerConfig"], training=parts["TrainingConfig"],
                     parallel=parts["ParallelConfig"], logging=parts["LoggingConfig"]), launch


def describe_no_effect(launch: LaunchOptions) -> str | None:
    """One start-up line naming the flags given that change nothing here, and why."""
    if not launch.no_effect:
        return None
    parts = [f"{name} ({COMPAT_FLAGS[name].reason})" if name in COMPAT_FLAGS else name
             for name in launch.no_effect]
    return "accepted, no effect: " + "; ".join(parts)


def describe_demo(launch: LaunchOptions, model: ModelConfig) -> str | None:
    """The start-up line of the embedded demo: what it set, and whether the model is LLaMA-style
    (None outside the demo)."""
    if not launch.demo_flags:
        return None
    llama = all(getattr(model, k) == v for k, v in LLAMA_ARCHITECTURE.items())
    kind = "a LLaMA-style model" if llama else "the model of the flags"
    return (f"embedded demo (no --data-path), {kind}: " + " ".join(launch.demo_flags)
            + " (Megatron's defaults otherwise)")


__all__ = ["GROUPS", "LaunchOptions", "add_config_flags", "as_flag",
           "build_parser", "config_from_args", "config_values", "demo_settings", "describe_demo",
           "describe_no_effect",
           "parse_flags"]
