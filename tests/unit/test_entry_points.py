"""The commands: every ``[project.scripts]`` entry point of pyproject.toml names a callable
``main(argv)``; every ``tools/X.py`` is a wrapper over the entry point ``megatron-h2-X`` that
leaves sys.path alone and runs from any directory (the package is installed, editable, by
requirements.txt)."""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def entry_points() -> dict[str, str]:
    """``{command: "module:function"}`` of pyproject.toml's ``[project.scripts]``."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def _resolve(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def test_every_entry_point_is_a_main_that_takes_argv(capsys):
    scripts = entry_points()
    assert all(re.fullmatch(r"megatron-h2-[a-z-]+", name) for name in scripts), scripts
    for name, target in scripts.items():
        main = _resolve(target)
        assert callable(main), name
        with pytest.raises(SystemExit) as done:  # argparse's --help exits 0
            main(["--help"])
        assert done.value.code == 0, name
        assert "usage:" in capsys.readouterr().out, name


def _wrapped_module(path: Path) -> str:
    """The module whose ``main`` the wrapper ``path`` imports."""
    tree = ast.parse(path.read_text(), str(path))
    modules = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               and [a.name for a in node.names] == ["main"]]
    assert len(modules) == 1, f"{path.name}: import main from one module"
    return modules[0]


def test_every_tool_wraps_its_entry_point_and_leaves_sys_path_alone():
    scripts = entry_points()
    tools = sorted((ROOT / "tools").glob("*.py"))
    assert tools
    for path in tools:
        text = path.read_text()
        assert "sys.path" not in text and "PYTHONPATH" not in text, path.name
        command = "megatron-h2-" + path.stem.replace("_", "-")
        assert command in scripts, f"{path.name}: no entry point {command} in pyproject.toml"
        assert scripts[command] == f"{_wrapped_module(path)}:main", path.name


def test_a_tool_runs_from_outside_the_clone(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "plan.py"), "--help"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: tools/plan.py")
