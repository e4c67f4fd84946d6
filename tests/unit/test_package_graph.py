"""Imports follow the dependency graph (megatron_h2.package_graph.DEPENDS_ON); the torch-free
packages stay torch-free; old module paths keep working."""

from __future__ import annotations

import ast
import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import megatron_h2
from megatron_h2.moved_modules import MOVED
from megatron_h2.package_graph import DEPENDS_ON, TORCH_FREE, edges, layers

ROOT = Path(megatron_h2.__file__).resolve().parent


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in ``path``, function-level ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def graph_violations(package_root: Path) -> list[str]:
    """Every import in ``package_root`` that the graph does not allow, every import of torch in
    a torch-free package, and every import of a moved module by its old path."""
    problems = []
    for path in sorted(package_root.rglob("*.py")):
        rel = path.relative_to(package_root)
        if rel.parts == ("__init__.py",):
            continue
        own = rel.parts[0].removesuffix(".py")
        if own not in DEPENDS_ON:
            problems.append(f"{rel}: '{own}' is not in megatron_h2.package_graph.DEPENDS_ON")
            continue
        for line, module in _imports(path):
            parts = module.split(".")
            if own in TORCH_FREE and parts[0] == "torch":
                problems.append(f"{rel}:{line}: {own} is torch-free but imports {module}")
            if parts[0] != "megatron_h2" or len(parts) < 2 or parts[1] == own:
                continue
            if module in MOVED:
                problems.append(f"{rel}:{line}: imports {module} by its old path "
                                f"(now {MOVED[module]})")
            elif parts[1] not in DEPENDS_ON[own]:
                problems.append(f"{rel}:{line}: {own} may not import {module} "
                                f"(allowed: {', '.join(sorted(DEPENDS_ON[own])) or 'nothing'})")
    return problems


def test_every_import_follows_the_graph():
    assert graph_violations(ROOT) == []


def test_a_planted_upward_or_sideways_import_is_caught(tmp_path):
    copy = tmp_path / "megatron_h2"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))

    def plant(rel: str, code: str) -> None:
        target = copy / rel
        target.write_text(target.read_text() + code)

    plant("distributed/bridge.py", "\n\ndef _late():\n"
          "    from megatron_h2.training.step import StepRunner  # planted: upward\n")
    plant("data/tokenizer.py", "\nimport megatron_h2.devices.accelerator  # planted: sideways\n")
    plant("planner/cluster.py", "\nimport torch.distributed\n")
    plant("plan/orders.py", "\nfrom megatron_h2.devices import Accelerator\n")
    found = graph_violations(copy)
    assert any("bridge.py" in p and "megatron_h2.training.step" in p for p in found), found
    assert any("tokenizer.py" in p and "megatron_h2.devices" in p for p in found), found
    assert any("cluster.py" in p and "torch.distributed" in p for p in found), found
    assert any("orders.py" in p and "megatron_h2.devices" in p for p in found), found
    assert len(found) == 4


def test_every_package_is_in_the_graph():
    packages = {p.name.removesuffix(".py") for p in ROOT.iterdir()
                if (p.is_dir() and (p / "__init__.py").exists()) or
                (p.suffix == ".py" and p.name != "__init__.py")}
    assert packages == set(DEPENDS_ON)
    assert all(deps <= set(DEPENDS_ON) for deps in DEPENDS_ON.values())


def test_the_graph_has_no_cycle_and_torch_free_packages_depend_on_torch_free_ones():
    order = layers()
    assert sum(len(level) for level in order) == len(DEPENDS_ON)
    assert all(b in TORCH_FREE for a, b in edges() if a in TORCH_FREE)


def test_importing_the_planner_loads_no_torch():
    code = ("import sys, megatron_h2.planner, megatron_h2.plan, megatron_h2.planner.cli; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT.parent)
    assert out.stdout.strip() == "False"


def test_moved_modules_stay_importable_from_their_old_paths():
    for old, new in MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    from megatron_h2.hetero_plan import HeteroPlan  # a script written against the old layout

    from megatron_h2.plan.schema import HeteroPlan as Current
    assert HeteroPlan is Current


def test_no_module_file_name_repeats():
    names = [p.name for p in ROOT.rglob("*.py") if p.name != "__init__.py"]
    assert sorted({n for n in names if names.count(n) > 1}) == []
