"""The command line of ``pretrain_gpt.py``, generated from the typed configs.

Every flag is a field of a config dataclass declared with :func:`megatron_h2.config.flag`
(name, help, choices, default), so ``--help`` shows each flag's meaning and default and there is
no second list of flags. Flags that Megatron-LM scripts pass but that change nothing here are
listed once in :data:`COMPAT_FLAGS` and reported at start-up. Abbreviated flags are not
accepted (``--num-layer`` is an error, as is any unknown flag, in one line naming the closest
known flag).
"""

from __future__ import annotations

import argparse
import difflib
import types
import typing
from dataclasses import dataclass
from typing import Any

from megatron_h2.config import (
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RunConfig,
    TrainingConfig,
    cli_fields,
    flag,
    flag_name,
)
from megatron_h2.errors import ConfigError


@dataclass
class LaunchOptions:
    """Options that shape this launch but are not part of the saved run config."""

    ckpt_step: int | None = flag(None, "Load this iteration instead of the latest.")
    no_load_optim: bool = flag(False, "Do not load the optimizer state when loading a checkpoint.")
    no_load_rng: bool = flag(False, "Do not load the RNG states when loading a checkpoint.")
    finetune: bool = flag(False, "Load model weights only and start at iteration 0.")
    explicit: frozenset[str] = frozenset()  # config fields the user set on the command line
    no_effect: tuple[str, ...] = ()  # compatibility flags given (reported at start-up)
    demo_flags: tuple[str, ...] = ()  # what the embedded demo set that the user did not


GROUPS: tuple[tuple[str, type], ...] = (
    ("model", ModelConfig),
    ("data", DataConfig),
    ("optimizer", OptimizerConfig),
    ("training", TrainingConfig),
    ("parallelism (DP = world size / (TP x PP))", ParallelConfig),
    ("checkpoint loading", LaunchOptions),
)

# Flags Megatron-LM's scripts pass that megatron_h2 accepts without effect, with the reason
# (said once at start-up), and whether they take a value.
COMPAT_FLAGS: dict[str, tuple[bool, str]] = {
    "--use-mcore-models": (False, "there is one model implementation"),
    "--no-masked-softmax-fusion": (False, "attention runs through torch's SDPA"),
    "--distributed-backend": (True, "each chip type's backend comes from the device layer"),
    "--num-workers": (True, "samples are read from memory-mapped files in the training process"),
    "--group-query-attention": (False, "grouped-query attention follows --num-query-groups"),
    "--use-rotary-position-embeddings": (False, "rotary positions are always used"),
    "--swiglu": (False, "the MLP is always SwiGLU"),
    "--disable-bias-linear": (False, "linear layers never have biases"),
    "--untie-embeddings-and-output-weights": (False, "embedding and output layer are untied"),
}
# Megatron flags whose value must be the fixed architecture megatron_h2 builds.
FIXED_CHOICES: dict[str, str] = {"--normalization": "RMSNorm", "--position-embedding-type": "rope"}


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
        text += " (required)"
    elif "default:" not in text:
        text += f" (default: {default!r})"
    kind = _base_type(hint)
    common = {"dest": dest, "default": argparse.SUPPRESS, "help": text}
    if kind is bool:
        action = "store_false" if meta["negative"] else "store_true"
        group.add_argument(flag_name(f), action=action, **common)
    else:
        if typing.get_origin(kind) is list and meta["parse"] is None:
            item = typing.get_args(kind)[0]
            common["nargs"] = "+"
            kind = item
        if typing.get_origin(kind) is typing.Literal:
            kind = str
        parse = meta["parse"] or kind
        group.add_argument(flag_name(f), type=_converter(parse),
                           choices=meta["choices"],
                           metavar=None if meta["choices"] else (meta["metavar"] or f.name.upper()),
                           **common)
    for name, value, help_text in meta["shortcuts"]:
        group.add_argument(name, action="store_const", const=value, dest=dest,
                           default=argparse.SUPPRESS, help=help_text)


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
    for title, cls in GROUPS:
        group = p.add_argument_group(title)
        hints = typing.get_type_hints(cls)
        for f in cli_fields(cls):
            _add_field(group, cls, f, hints[f.name])
    compat = p.add_argument_group("accepted for Megatron compatibility, without effect")
    for name, (takes_value, reason) in COMPAT_FLAGS.items():
        kwargs = {"metavar": "VALUE"} if takes_value else {"action": "store_true"}
        compat.add_argument(name, dest=f"compat.{name}", default=argparse.SUPPRESS,
                            help=reason, **kwargs)
    for name, value in FIXED_CHOICES.items():
        compat.add_argument(name, dest=f"compat.{name}", choices=[value],
                            default=argparse.SUPPRESS, help=f"always {value}")
    return p


def _known_flags(parser: argparse.ArgumentParser) -> list[str]:
    return [s for action in parser._actions for s in action.option_strings]


def parse_flags(argv: list[str] | None) -> tuple[dict[str, dict[str, Any]], tuple[str, ...]]:
    """``{class name: {field: value}}`` of the flags given, and the compatibility flags given."""
    parser = build_parser()
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        bad = next((u for u in unknown if u.startswith("-")), unknown[0])
        name = bad.split("=", 1)[0]
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
# these values replace Megatron's defaults where they suit a small model trained for minutes.
DEMO_OVERRIDES: dict[str, dict[str, Any]] = {
    "ModelConfig": {"hidden_dropout": 0.0, "attention_dropout": 0.0},
    "OptimizerConfig": {"lr_warmup_iters": 20, "lr_decay_style": "cosine", "min_lr": 1e-4,
                        "weight_decay": 0.1, "adam_beta2": 0.95},
    "TrainingConfig": {"global_batch_size": 8, "log_interval": 10, "eval_interval": 100,
                       "eval_iters": 5},
}


def _check_required(given: dict[str, dict[str, Any]]) -> None:
    plan_owned = {"micro_batch_size"} if given["ParallelConfig"].get("hetero_plan") else set()
    for _, cls in GROUPS:
        for f in cli_fields(cls):
            if f.name in plan_owned:
                continue
            if f.metadata["cli"]["required"] and f.name not in given[cls.__name__]:
                raise ConfigError(f"{flag_name(f)} is required with --data-path (only the "
                                  "embedded demo, without --data-path, has defaults for it)")


def demo_settings(given: dict[str, dict[str, Any]]) -> list[str]:
    """The flags the embedded demo uses that the user did not give, as ``--flag value``."""
    out = []
    for _, cls in GROUPS:
        overrides = DEMO_OVERRIDES.get(cls.__name__, {})
        for f in cli_fields(cls):
            mine = given[cls.__name__]
            if f.name in mine:
                continue
            if f.name in overrides:
                out.append(f"{flag_name(f)} {overrides[f.name]}")
            elif f.metadata["cli"]["required"]:
                out.append(f"{flag_name(f)} {f.default}")
    return out


def config_from_args(argv: list[str] | None = None) -> tuple[RunConfig, LaunchOptions]:
    """Parse Megatron-style flags into a validated :class:`RunConfig`."""
    given, compat = parse_flags(argv)
    if given["DataConfig"].get("data_path"):
        _check_required(given)
        values = given
        demo = ()
    else:  # the embedded demo
        values = {name: {**DEMO_OVERRIDES.get(name, {}), **mine} for name, mine in given.items()}
        demo = tuple(demo_settings(given))
    parts = {cls.__name__: cls(**values[cls.__name__]) for _, cls in GROUPS}
    explicit = frozenset(name for mine in given.values() for name in mine)
    launch = parts["LaunchOptions"]
    launch.explicit, launch.no_effect, launch.demo_flags = explicit, compat, demo
    return RunConfig(model=parts["ModelConfig"], data=parts["DataConfig"],
                     optimizer=parts["OptimizerConfig"], training=parts["TrainingConfig"],
                     parallel=parts["ParallelConfig"]), launch


def describe_no_effect(launch: LaunchOptions) -> str | None:
    """One start-up line naming the compatibility flags given and why they change nothing."""
    if not launch.no_effect:
        return None
    parts = [f"{name} ({COMPAT_FLAGS[name][1]})" if name in COMPAT_FLAGS else name
             for name in launch.no_effect]
    return "accepted, no effect: " + "; ".join(parts)


__all__ = ["COMPAT_FLAGS", "GROUPS", "LaunchOptions", "build_parser", "config_from_args",
           "demo_settings", "describe_no_effect", "parse_flags"]
