#!/usr/bin/env python3
"""Fingerprints of the plan search for checking that a faster search is the same search.

Each line is one search of a family member (planner_family.py) under a fixed prefix budget
(``SearchOptions.max_prefixes``, not a clock: the same work whatever the load) or, for the
small members, with no limit at all: its prefixes, pruned options, layer splits, shapes
pruned, proven bound, whether it finished, and every plan found (step time to 12 digits and
its stages). Run it on two trees and compare the outputs; they must be identical:

    PYTHONPATH=/tmp/base python bench/search_fingerprint.py > before.txt
    python bench/search_fingerprint.py > after.txt
    cmp before.txt after.txt

``--members SEED:SIZE[:TYPES]:BUDGET,...`` picks others (BUDGET 0: no limit); ``--cpu``
prints each search's CPU seconds and prefixes per CPU second to stderr (not compared).
"""

from __future__ import annotations

import argparse
import sys
import time

from planner_family import member

from megatron_h2.errors import ConfigError
from megatron_h2.planner import SearchOptions, search
from megatron_h2.planner.report import stage_summary

DEFAULT = (  # small clusters without a limit, then the family's slow members on a budget
    "0:64:0,1:64:0,2:64:0,3:64:0,4:64:0,0:256:3:0,1:256:4:0,"
    "1:1024:1000,3:1024:1500,1:10000:3000,0:100000:600"
)


def fingerprint(seed: int, size: int, types: int | None, budget: int) -> tuple[str, float]:
    """One search's fingerprint line and its CPU seconds."""
    item = member(seed, size, types)
    options = SearchOptions(
        item.global_batch_size, top_k=5, time_limit_s=1e9,
        max_prefixes=budget if budget else None,
    )  # fmt: skip
    cpu = time.process_time()
    try:
        result = search(item.cost, options)
    except ConfigError as error:
        return f"{item.label}: {error}", time.process_time() - cpu
    cpu = time.process_time() - cpu
    s = result.stats
    plans = "; ".join(
        f"{c.estimate.step_time_s:.12g} {stage_summary(c.plan)}" for c in result.candidates
    )
    line = (
        f"{item.label} budget {budget}: prefixes {s.nodes} pruned {s.nodes_pruned}"
        f" splits {s.splits_solved} shapes {s.batch_shapes}/{s.batch_shapes_pruned}"
        f" bound {s.lower_bound_s:.12g} exhaustive {s.exhaustive} plans {plans}"
    )
    return line, cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", default=DEFAULT)
    parser.add_argument("--cpu", action="store_true", help="CPU seconds to stderr")
    args = parser.parse_args()
    for spec in args.members.split(","):
        parts = [int(p) for p in spec.split(":")]
        seed, size, budget = parts[0], parts[1], parts[-1]
        types = parts[2] if len(parts) == 4 else None
        line, cpu = fingerprint(seed, size, types, budget)
        print(line, flush=True)
        if args.cpu:
            nodes = line.split(" prefixes ")[1].split()[0] if " prefixes " in line else "0"
            print(f"{spec}: {cpu:.2f} s CPU, {int(nodes) / max(cpu, 1e-9):.0f} prefixes per CPU s",
                  file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
