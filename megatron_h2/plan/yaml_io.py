"""Checks shared by the YAML files users write (plans, clusters, model descriptions, profiles):
exact keys with the closest valid one on a typo, typed positive numbers, and reading a file that
must hold a mapping; every failure is a one-line :class:`~megatron_h2.errors.ConfigError`."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from megatron_h2.errors import ConfigError


def closest(word: str, valid: Sequence[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest valid word, or ``""`` if none is close."""
    match = difflib.get_close_matches(word, list(valid), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def check_keys(
    data: Any, required: Sequence[str], optional: Sequence[str], where: str
) -> Mapping[str, Any]:
    """Check that ``data`` is a mapping with exactly the known keys; return it.

    Unknown keys are reported first (with the closest valid key), so that a misspelt key gives
    "unknown key 'tensor_paralel_size' ... (did you mean 'tensor_parallel_size'?)" rather than
    "missing key".
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a mapping of keys to values, got {type(data).__name__}")
    valid = list(required) + list(optional)
    for key in data:
        if key not in valid:
            raise ConfigError(
                f"unknown key '{key}' in {where}{closest(str(key), valid)}; "
                f"valid keys: {', '.join(valid)}"
            )
    for key in required:
        if key not in data:
            raise ConfigError(
                f"missing key '{key}' in {where}; add it (valid keys: {', '.join(valid)})"
            )
    return data


def positive_int(value: Any, name: str, minimum: int = 1) -> int:
    """Return ``value`` if it is an int (not a bool) of at least ``minimum``, else raise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        what = "positive" if minimum == 1 else f"at least {minimum}"
        raise ConfigError(f"{name} must be {what}, got {value}")
    return value


def positive_float(value: Any, name: str, minimum: float = 0.0, inclusive: bool = False) -> float:
    """Return ``value`` as a float if it is a number above ``minimum`` (or equal if inclusive)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    ok = value >= minimum if inclusive else value > minimum
    if not ok or value != value or value == float("inf"):
        bound = f"at least {minimum}" if inclusive else f"greater than {minimum}"
        raise ConfigError(f"{name} must be a finite number {bound}, got {value}")
    return float(value)


def load_yaml_mapping(path: str | Path, what: str) -> Mapping[str, Any]:
    """Read a YAML file that must hold a mapping; every failure is a one-line ConfigError."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} file '{path}': {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} file '{path}' is not UTF-8 text (byte {exc.start}); give the "
                          "YAML file, not a binary one") from None
    try:
        data = yaml.safe_load(text)
    except RecursionError:
        raise ConfigError(f"{what} file '{path}' is nested too deeply to be a {what}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"{what} file '{path}' is not valid YAML{where}: {problem}") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"{what} file '{path}' must hold a mapping at the top level")
    return data
