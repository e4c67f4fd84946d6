"""Which package of megatron_h2 may import which: the dependency graph, written once.

``DEPENDS_ON[a]`` lists the packages (and top-level modules) that the modules of ``a`` may
import directly; a package always imports from itself. ``tests/unit/test_package_graph.py``
checks every import of the package against it (function-level imports included), that the graph
has no cycle, and that the torch-free packages (:data:`TORCH_FREE`) import neither torch nor a
package that does. ``docs/architecture.md`` draws the same graph; a test compares the two.

Read from the bottom up:

- ``errors``: the one-line errors users see.
- ``config``: typed run configuration, the one model description (parameter, FLOP and memory
  counts) and Megatron's flag table.
- ``plan``: the plan file (stages, chips, TP, DP, layers, schedule) with its rank arithmetic,
  the pipeline schedules' orders, and the strict YAML reading of user files.
- ``planner``: HeteroAuto: cost model, search, simulator; writes plans.
- ``devices`` (DiTorch), ``data``: one interface over each vendor's torch backend; datasets
  and tokenizers.
- ``distributed`` (DiComm): rank topology, process groups, point-to-point traffic, the
  cross-vendor bridge, data-parallel gradient buckets.
- ``parallel``, ``pipeline`` (HeteroPP): tensor / sequence-parallel layers; running a schedule.
- ``optimizer``, ``models``: AdamW and ZeRO-1; the GPT model per pipeline stage.
- ``checkpointing``: the checkpoint format, distributed save / load, conversions.
- ``monitoring``, ``measurement``: metrics, timers, timelines, health and precision checks;
  measuring a chip for the planner.
- ``training``: the run: command line, building a run, the loop, one step.
- ``elastic``: restarting a job on the chips that are left, re-planned.
- ``commands``: the entry points behind ``tools/``.
"""

from __future__ import annotations

DEPENDS_ON: dict[str, frozenset[str]] = {
    name: frozenset(deps) for name, deps in {
        "errors": (),
        "package_graph": (),
        "moved_modules": (),
        "config": ("errors",),
        "plan": ("errors", "config"),
        "planner": ("errors", "config", "plan"),
        "devices": ("errors",),
        "data": ("errors", "config"),
        "distributed": ("errors", "config", "plan", "devices"),
        "parallel": ("errors", "distributed"),
        "pipeline": ("errors", "plan", "distributed"),
        "optimizer": ("errors", "config", "devices", "distributed"),
        "models": ("errors", "config", "devices", "parallel"),
        "checkpointing": ("errors", "config", "plan", "devices", "distributed", "parallel",
                          "optimizer", "models"),
        "monitoring": ("errors", "config", "plan", "devices", "distributed", "optimizer",
                       "models"),
        "measurement": ("errors", "config", "planner", "devices", "optimizer", "models",
                        "monitoring"),
        "training": ("errors", "config", "plan", "devices", "data", "distributed", "parallel",
                     "pipeline", "optimizer", "models", "checkpointing", "monitoring"),
        "elastic": ("errors", "config", "plan", "planner", "devices", "checkpointing",
                    "monitoring", "training"),
        "commands": ("errors", "config", "plan", "planner", "devices", "data", "distributed",
                     "optimizer", "models", "checkpointing", "monitoring", "measurement",
                     "training"),
    }.items()
}
"""Package -> the packages its modules may import (besides itself)."""

TORCH_FREE: frozenset[str] = frozenset(
    {"errors", "package_graph", "moved_modules", "config", "plan", "planner"})
"""Packages that must not import torch, so that planning runs where torch is not installed."""


def layers() -> list[list[str]]:
    """The packages in dependency order: each list holds the packages whose dependencies all
    lie in earlier lists (for drawing the graph bottom-up). Raises ValueError on a cycle."""
    placed: set[str] = set()
    out: list[list[str]] = []
    while len(placed) < len(DEPENDS_ON):
        ready = sorted(n for n, deps in DEPENDS_ON.items() if n not in placed and deps <= placed)
        if not ready:
            raise ValueError(f"cycle among {sorted(set(DEPENDS_ON) - placed)}")
        out.append(ready)
        placed.update(ready)
    return out


def edges() -> list[tuple[str, str]]:
    """Every allowed dependency ``(importer, imported)``, sorted."""
    return sorted((a, b) for a, deps in DEPENDS_ON.items() for b in deps)


def reduced_edges() -> list[tuple[str, str]]:
    """The allowed dependencies minus those implied by others (``a -> c`` is left out when
    ``a -> b -> ... -> c``): the graph as ``docs/architecture.md`` draws it."""

    def reachable(start: str) -> set[str]:
        seen: set[str] = set()
        todo = list(DEPENDS_ON[start])
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo.extend(DEPENDS_ON[name])
        return seen

    return [(a, b) for a, b in edges()
            if not any(b in reachable(c) for c in DEPENDS_ON[a] if c != b)]


def mermaid() -> str:
    """The graph as a Mermaid flowchart, the one ``docs/architecture.md`` shows: an arrow
    ``a --> b`` says that ``a`` imports ``b``; torch-free packages are marked."""
    lines = ["flowchart TD"]
    shown = {n for edge in reduced_edges() for n in edge}
    for level in reversed(layers()):
        for name in level:
            if name in shown:
                lines.append(f"    {name}" + (":::torchfree" if name in TORCH_FREE else ""))
    lines += [f"    {a} --> {b}" for a, b in reduced_edges()]
    lines.append("    classDef torchfree fill:#e8f4e8,stroke:#2a7a2a")
    return "\n".join(lines)


if __name__ == "__main__":
    print(mermaid())
