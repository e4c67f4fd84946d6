"""docs/architecture.md names modules, functions and files that exist, draws the dependency
graph the code enforces, and lists a public API that imports."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from megatron_h2.package_graph import mermaid

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
DOC = (REPO / "docs" / "architecture.md").read_text()


def resolve(dotted: str) -> object:
    """The module, class, function or attribute ``dotted`` names (ImportError / AttributeError
    when it no longer exists)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def test_every_named_module_and_function_exists():
    names = set(re.findall(r"`(megatron_h2(?:\.\w+)+)`", DOC))
    assert len(names) > 30
    missing = []
    for name in sorted(names):
        try:
            resolve(name)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{name} ({exc})")
    assert missing == []


def test_every_named_file_exists():
    paths = {p for p in re.findall(r"`([\w./-]+\.(?:py|md|yaml))`", DOC) if "/" in p}
    assert paths
    assert sorted(p for p in paths if not (REPO / p).exists()) == []


def test_the_picture_is_the_enforced_graph():
    block = re.search(r"```mermaid\n(.*?)\n```", DOC, re.S)
    assert block is not None
    assert block.group(1) == mermaid()


def test_the_public_api_imports():
    section = DOC.split("## Public API", 1)[1]
    rows = re.findall(r"^\| `(megatron_h2[\w.]*)` \| (.+) \|$", section, re.M)
    assert {module for module, _ in rows} >= {"megatron_h2.config", "megatron_h2.models",
                                               "megatron_h2.checkpointing", "megatron_h2.plan",
                                               "megatron_h2.planner", "megatron_h2.training"}
    for module, names in rows:
        imported = importlib.import_module(module)
        for name in re.findall(r"`(\w+)`", names):
            assert hasattr(imported, name), f"{module}.{name}"
