"""Where a family member's proven gap sits at the time limit (``bench_planner.py --family``'s
search, limits in CPU seconds): which batch shapes and suffixes hold the lowest bounds left,
and, for the lowest few, the exact best plan below them (that suffix or shape searched alone,
best first, for ``--solve`` more CPU seconds; ``--solve 0`` lists the places only): how loose
each bound is.

    cd bench && ../.venv/bin/python bench_planner_gap.py --size 10000 --seed 1 --limit 30

Prints one row per place: its bound, the shape (micro-batch, schedule, V, DP or ``own``), the
suffix (kind: chip TP DP x stages, front first) or ``root`` / ``root children``, and the
subtree's proven lower bound and best plan after the extra search (``exact`` if finished; a
finished search with no plan below its cutoff, 1.2 x the best plan, prints the cutoff as its
lower bound). It wraps the search's private ``_Search._stop`` and ``_bound_by_children``.
"""

from __future__ import annotations

import argparse
import heapq
import time
from typing import Any

from planner_family import member, use_cpu_clock

from megatron_h2.planner.search import SearchOptions, _Search
from megatron_h2.planner.suffixes import Left, root_node

INF = float("inf")


def shape_label(shape: Any) -> str:
    dp = "own" if shape.dp is None else f"DP{shape.dp}"
    sched = shape.schedule + (f" V{shape.chunks}" if shape.chunks > 1 else "")
    return f"b{shape.mbs} {sched} {dp}"


def suffix_label(shape: Any, suffix: Any) -> str:
    parts = []
    for kind, count in suffix:
        k = shape.kinds[kind]
        parts.append(f"{k.name} TP{k.tp} DP{k.dp} x{count}")
    return " | ".join(parts) if parts else "root"


def run(size: int, seed: int, limit: float, solve: float, rows: int) -> None:
    item = member(seed, size)
    print(item.label)
    use_cpu_clock()
    options = SearchOptions(item.global_batch_size, top_k=5, time_limit_s=limit,
                            schedules=("1f1b", "interleaved", "zero-bubble"))
    places: list[tuple[float, str, Any]] = []
    original_stop = _Search._stop

    def stop(self: _Search, left: Left) -> None:
        for bound, shape in left.roots:
            places.append((bound, f"{shape_label(shape)}: root children", ("roots", shape)))
        for entry in left.queue:
            bound, _, shape, kind, count, node = entry
            what = "close" if kind < 0 else suffix_label(shape, ((kind, count),))
            depth = len(node.suffix)
            places.append((bound, f"{shape_label(shape)}: [{suffix_label(shape, node.suffix)}]"
                           f" depth {depth} + {what}", ("entry", entry)))
        original_stop(self, left)
        for shape in left.shapes:  # kept at their roots (the others: by_children)
            root = shape.root_bound()
            if id(shape) not in reached and root < self.threshold:
                places.append((root, f"{shape_label(shape)}: not reached, root",
                               ("shape", shape)))

    original_children = _Search._bound_by_children

    reached: set[int] = set()

    def by_children(self: _Search, shape: Any) -> None:
        reached.add(id(shape))
        before = self.stats.lower_bound_s
        self.stats.lower_bound_s = INF
        original_children(self, shape)
        places.append((self.stats.lower_bound_s, f"{shape_label(shape)}: not reached, root"
                       " children at the stop", ("shape", shape)))
        self.stats.lower_bound_s = min(before, self.stats.lower_bound_s)

    _Search._stop = stop
    _Search._bound_by_children = by_children
    started = time.process_time()
    state = _Search(item.cost, options)
    found = state.run()
    _Search._stop = original_stop
    _Search._bound_by_children = original_children
    best = found[0].value if found else INF
    lower = state.stats.lower_bound_s
    print(f"search: {time.process_time() - started:.1f} s CPU, best {best:.4f}, proven lower"
          f" {lower:.4f}, gap {100 * (best / lower - 1):.1f}%; {len(places)} places left")
    places.sort(key=lambda p: p[0])
    shapes: dict[str, float] = {}
    for bound, label, _ in places:
        key = label.split(":")[0]
        shapes[key] = min(shapes.get(key, INF), bound)
    print("lowest bound per shape (first 12):")
    for key, bound in sorted(shapes.items(), key=lambda p: p[1])[:12]:
        print(f"  {bound:.4f} ({100 * (best / bound - 1):.1f}% below best)  {key}")
    if solve <= 0:  # --solve 0: the places only
        print(f"lowest {rows} places (not searched alone: --solve 0):")
        for bound, label, _ in places[:rows]:
            print(f"  {bound:.4f}  {label}")
        return
    print(f"lowest {rows} places, each searched alone for {solve:.0f} s of CPU:")
    for bound, label, what in places[:rows]:
        sub_lower, sub_best, done = _solve_alone(item.cost, options, what, best, solve)
        verdict = "exact" if done else "at limit"
        print(f"  {bound:.4f}  {label}\n      alone: lower {sub_lower:.4f}, best {sub_best:.4f}"
              f" ({verdict}); bound / subtree lower {bound / sub_lower:.3f}")


def _solve_alone(cost: Any, options: SearchOptions, what: tuple[str, Any], best: float,
                 budget: float) -> tuple[float, float, bool]:
    """Search one place alone (top 1, cutoff 1.2 x ``best``; a dive of 96 prefixes, then best
    first): its proven lower bound, best plan and whether it finished."""
    one = SearchOptions(options.global_batch_size, top_k=1, time_limit_s=budget,
                        schedules=options.schedules, cutoff_s=best * 1.2)
    state = _Search(cost, one)
    kind, obj = what
    if kind == "entry":  # the suffix keeps its shape's grid (its capacity groups are on it)
        shape = obj[2]
        queue = [obj[:1] + (next(state.counter),) + obj[2:]]
    else:
        shape = obj
        shape.prepare()
        if kind == "shape":
            shape.build_grid(1.2 * best, options.grid_points)
        queue = [(shape.root_bound(), next(state.counter), shape, 0, 0, root_node(shape))]
    state.deadline = time.process_time() + budget
    node = queue[0][5]
    if kind == "entry" and queue[0][3] >= 0 and queue[0][4]:
        entry = queue[0]
        links = state._block_links(shape, node, entry[3], entry[4])
        node = node.child(shape, entry[3], entry[4], links)
    if kind != "entry" or queue[0][3] >= 0:
        state._explore(shape, node, budget=state.options.dive_nodes * 4)  # a plan to beat
    heapq.heapify(queue)
    left = state._best_first([], use_all=False, queue=queue)
    sub_best = state.best[0][2].value if state.best else INF
    head = left[0] if left else None
    if head is not None:
        print(f"      alone, at its limit: lowest left at depth {len(head[5].suffix)}:"
              f" [{suffix_label(shape, head[5].suffix)}] + "
              + ("close" if head[3] < 0 else suffix_label(shape, ((head[3], head[4]),))))
    if not left:  # exhaustive: its best, or nothing below the cutoff (1.2 x the best)
        return min(sub_best, best * 1.2), sub_best, True
    return left[0][0], sub_best, False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--limit", type=float, required=True, help="CPU seconds")
    parser.add_argument("--solve", type=float, default=20.0,
                        help="CPU s per place alone (0: list the places without solving them)")
    parser.add_argument("--rows", type=int, default=4)
    args = parser.parse_args()
    if args.solve < 0:
        parser.error("--solve must be 0 (skip solving places alone) or positive")
    run(args.size, args.seed, args.limit, args.solve, args.rows)


if __name__ == "__main__":
    main()
