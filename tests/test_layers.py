"""Imports point one way: no module imports from a higher layer (megatron_h2.LAYERS)."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import megatron_h2
from megatron_h2 import LAYERS

ROOT = Path(megatron_h2.__file__).resolve().parent


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, function-level ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def layer_violations(package_root: Path) -> list[str]:
    """Every import in ``package_root`` that runs upward or sideways, or torch in the planner."""
    problems = []
    for path in sorted(package_root.rglob("*.py")):
        rel = path.relative_to(package_root)
        if rel.parts == ("__init__.py",):
            continue
        own = rel.parts[0].removesuffix(".py")
        if own not in LAYERS:
            problems.append(f"{rel}: module '{own}' has no layer in megatron_h2.LAYERS")
            continue
        for line, module in _imports(path):
            parts = module.split(".")
            if own == "planner" and parts[0] == "torch":
                problems.append(f"{rel}:{line}: the planner imports {module}")
            if parts[0] != "megatron_h2" or len(parts) < 2 or parts[1] == own:
                continue
            other = parts[1]
            if other not in LAYERS:
                problems.append(f"{rel}:{line}: imports {module}, which has no layer")
            elif LAYERS[other] >= LAYERS[own]:
                problems.append(f"{rel}:{line}: {own} (layer {LAYERS[own]}) imports {module} "
                                f"(layer {LAYERS[other]})")
    return problems


def test_no_import_runs_upward():
    assert layer_violations(ROOT) == []


def test_a_planted_upward_import_is_caught(tmp_path):
    copy = tmp_path / "megatron_h2"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / "distributed" / "bridge.py"
    target.write_text(target.read_text() + "\n\ndef _late():\n"
                      "    from megatron_h2.training.step import StepRunner  # planted\n")
    (copy / "planner" / "cluster.py").write_text(
        (copy / "planner" / "cluster.py").read_text() + "\nimport torch.distributed\n")
    found = layer_violations(copy)
    assert any("bridge.py" in p and "megatron_h2.training.step" in p for p in found), found
    assert any("cluster.py" in p and "torch.distributed" in p for p in found), found
    assert len(found) == 2


def test_every_package_has_a_layer():
    packages = {p.name.removesuffix(".py") for p in ROOT.iterdir()
                if (p.is_dir() and (p / "__init__.py").exists()) or
                (p.suffix == ".py" and p.name != "__init__.py")}
    assert packages == set(LAYERS)
