"""Checks shared by the YAML files users write (plans, clusters, model descriptions, profiles):
exact keys with the closest valid one on a typo, typed positive numbers bounded to what a cluster
can hold (checked before any arithmetic on them), and reading a file that must hold a mapping
with no key given twice; every failure is a one-line :class:`~megatron_h2.errors.ConfigError`."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from megatron_h2.errors import ConfigError

#: Largest count a plan, cluster, model or profile file may give (chips, samples in a batch,
#: layers, sizes): 2**24 = 16,777,216, above any cluster's chips or batch; a larger number is a
#: typo, and would overflow or exhaust memory in the arithmetic that follows.
MAX_COUNT = 2**24
#: Largest figure (TFLOP/s, GiB, GB/s, seconds, factors) such a file may give.
MAX_FIGURE = 1e9


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


def _shown(value: int | float) -> str:
    """A number as the error message shows it: huge integers by their size, not their digits."""
    if isinstance(value, int) and abs(value) >= 10**15:
        return f"a {len(str(abs(value)))}-digit number"
    return str(value)


def positive_int(value: Any, name: str, minimum: int = 1, maximum: int = MAX_COUNT) -> int:
    """Return ``value`` if it is an int (not a bool) in ``[minimum, maximum]``, else raise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        what = "positive" if minimum == 1 else f"at least {minimum}"
        raise ConfigError(f"{name} must be {what}, got {_shown(value)}")
    if value > maximum:
        raise ConfigError(f"{name} must be at most {maximum:,} (no cluster holds more), got "
                          f"{_shown(value)}")
    return value


def positive_float(value: Any, name: str, minimum: float = 0.0, inclusive: bool = False,
                   maximum: float = MAX_FIGURE) -> float:
    """Return ``value`` as a float if it is a finite number above ``minimum`` (or equal if
    inclusive) and at most ``maximum``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    ok = value >= minimum if inclusive else value > minimum
    if not ok or value != value or value > maximum:
        bound = f"at least {minimum}" if inclusive else f"greater than {minimum}"
        raise ConfigError(f"{name} must be a finite number {bound} and at most {maximum:g}, got "
                          f"{_shown(value)}")
    return float(value)


class _DuplicateKey(Exception):
    """A mapping gives a key twice (raised while the YAML is read, turned into ConfigError)."""

    def __init__(self, key: Any, first: int, second: int) -> None:
        super().__init__(key, first, second)
        self.key, self.first, self.second = key, first, second


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise _DuplicateKey(key, seen[key], line)
                seen[key] = line
            except TypeError:
                continue  # an unhashable key: the base loader reports it
        return super().construct_mapping(node, deep=deep)


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
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as dup:
        where = (f"lines {dup.first} and {dup.second}" if dup.first != dup.second
                 else f"line {dup.first}")
        raise ConfigError(f"{what} file '{path}' gives the key '{dup.key}' twice ({where}); "
                          "keep one (YAML would silently take the last)") from None
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
