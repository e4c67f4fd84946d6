"""Root bounds of every batch shape of family members (one-DP and own-DP; no search, so the
figures do not depend on the machine's load): per member the lowest root bound, and per shape
the bounds written to a JSON file, so that two trees compare (``PYTHONPATH`` on each).

    cd bench && PYTHONPATH=<tree> ../.venv/bin/python bench_planner_roots.py --out roots.json \\
        --members 1024:1,1024:4,10000:0,10000:1,100000:0,100000:1,100000:3
    ../.venv/bin/python bench_planner_roots.py --compare before.json after.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from planner_family import member

from megatron_h2.planner.search import SearchOptions, _Search


def roots(size: int, seed: int) -> dict[str, float]:
    """Every batch shape's root bound of the member (key: micro-batch, schedule, V, DP)."""
    item = member(seed, size)
    state = _Search(item.cost, SearchOptions(item.global_batch_size, top_k=5))
    out = {}
    for own in (False, True):
        for shape in state._shapes(own=own):
            shape.prepare()
            dp = "own" if shape.dp is None else shape.dp
            out[f"b{shape.mbs} {shape.schedule} V{shape.chunks} DP{dp}"] = shape.root_bound()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", default="1024:1,10000:1")
    parser.add_argument("--out")
    parser.add_argument("--compare", nargs=2)
    args = parser.parse_args()
    if args.compare:
        before, after = (json.load(open(path)) for path in args.compare)
        for name, shapes in before.items():
            new = after[name]
            ratios = [new[k] / v for k, v in shapes.items() if 0 < v < float("inf")]
            low_b, low_a = min(shapes.values()), min(new.values())
            print(f"{name}: {len(shapes)} shapes, lowest root {low_b:.4f} -> {low_a:.4f};"
                  f" per shape after / before median {statistics.median(ratios):.3f},"
                  f" max {max(ratios):.3f}, min {min(ratios):.4f}")
        return
    result = {}
    for pair in args.members.split(","):
        size, seed = (int(x) for x in pair.split(":"))
        started = time.process_time()
        result[f"{size}:{seed}"] = shapes = roots(size, seed)
        print(f"{size}:{seed}: {len(shapes)} shapes, lowest root {min(shapes.values()):.4f}"
              f" ({time.process_time() - started:.1f} s CPU)", flush=True)
    if args.out:
        json.dump(result, open(args.out, "w"), indent=0)


if __name__ == "__main__":
    main()
