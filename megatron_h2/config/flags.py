"""Config fields that are command-line flags (:func:`flag`), and the small parsers and checks
the config dataclasses share."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import field, fields
from typing import Any

from megatron_h2.errors import ConfigError


def flag(default: Any = None, help: str = "", *, name: str | None = None,
         choices: tuple | None = None, negative: bool = False, required: bool = False,
         parse: Callable[[str], Any] | None = None, metavar: str | None = None,
         shortcuts: tuple[tuple[str, Any, str], ...] = (), unless: tuple[str, ...] = (),
         nargs: int | None = None, aliases: tuple[str, ...] = ()) -> Any:
    """A dataclass field that is also a command-line flag.

    ``name`` overrides the flag (default ``--field-name``); ``negative`` makes a bool flag that
    sets the field to False (Megatron's ``--disable-...`` / ``--no-...`` flags); ``required``
    flags must be given unless the run is the embedded demo, or one of the fields in ``unless``
    (the alternatives, e.g. ``--train-samples`` for ``--train-iters``; the embedded demo's value
    for the field is dropped when one of them is given) is given; ``parse``
    converts the text; ``shortcuts`` are extra flags ``(flag, value, help)`` that set the field
    to a fixed value; ``nargs`` fixes the number of values of a list flag; ``aliases`` are other
    names of the same flag (Megatron's renamed flags).
    """
    meta = {"help": help, "name": name, "choices": choices, "negative": negative,
            "required": required, "parse": parse, "metavar": metavar, "shortcuts": shortcuts,
            "unless": unless, "nargs": nargs, "aliases": aliases}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"cli": meta})
    return field(default=default, metadata={"cli": meta})


def cli_fields(cls: type) -> list:
    """The fields of a config dataclass that are command-line flags, in declaration order."""
    return [f for f in fields(cls) if "cli" in f.metadata]


def flag_name(f) -> str:
    """The command-line flag of a :func:`flag` field."""
    return f.metadata["cli"]["name"] or "--" + f.name.replace("_", "-")


#: Largest magnitude of a float flag: what a float32 tensor (weights, Adam's moments, learning
#: rates applied in the step) can hold; beyond it the first optimizer step overflows.
FLOAT32_MAX = 3.4028234663852886e38
#: Largest magnitude of an integer flag: exact in float64 and int64 alike (iterations, samples,
#: intervals, sizes enter both).
INT_MAX = 2**53


def finite_float(text: str) -> float:
    """A float flag's value: finite and within float32 range (``nan``, ``inf`` and ``1e39`` are
    refused at start-up instead of failing inside the optimizer)."""
    value = float(text)
    if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise ConfigError(f"expected a finite number of at most {FLOAT32_MAX:.3g} in magnitude "
                          f"(float32), got {text!r}")
    return value


finite_float.__name__ = "float"


def bounded_int(text: str) -> int:
    """An integer flag's value, at most 2**53 in magnitude."""
    value = int(text)
    if abs(value) > INT_MAX:
        raise ConfigError(f"expected an integer of at most 2**53 in magnitude, got a "
                          f"{len(text.strip().lstrip('+-'))}-digit number")
    return value


bounded_int.__name__ = "int"


def check_range(obj: object, name: str, low: float, high: float, *, low_open: bool = False,
                high_open: bool = False, flag: str | None = None) -> None:
    """One-line ConfigError unless ``low <(=) obj.name <(=) high`` (None passes: not given)."""
    value = getattr(obj, name)
    if value is None:
        return
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (above and below and math.isfinite(value)):
        left, right = "(" if low_open else "[", ")" if high_open else "]"
        flag = flag or "--" + name.replace("_", "-")
        raise ConfigError(f"{flag} must be in {left}{low:g}, {high:g}{right}, got {value:g}")


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


def layer_split(text: str) -> list[int] | list[list[int]]:
    """``3,1`` -> [3, 1] (layers per stage); ``2,1/1,2`` -> [[2, 1], [1, 2]] (per model chunk,
    the stages' counts of chunk 0, then of chunk 1: the layers in model order)."""
    try:
        chunks = [[int(x) for x in chunk.split(",")] for chunk in text.split("/")]
    except ValueError:
        raise ConfigError(f"--pipeline-layer-split expects layer counts per stage separated by "
                          f"',' and model chunks separated by '/', such as 3,1 or 2,1/1,2; got "
                          f"{text!r}") from None
    return chunks[0] if len(chunks) == 1 else chunks


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
