"""How long a checkpoint save stops training: ``--async-save`` against a synchronous save.

Runs of ``pretrain_gpt.py`` in this process on mock data, the same model and flags, in
alternating pairs (``--repeats``), one of each pair with ``--async-save``; each saves every
``--save-interval`` iterations. Printed, per run: the
median seconds training waited per save (synchronous: the whole save; background: gathering
the state and copying it to host memory, from the log line), the median seconds the background
writes took, the wall time of the whole run, and the ratio of the stalls. A background write
competes with training for the CPU, so on a machine with few cores the run's wall time gains
less than the stall ratio says.

    .venv/bin/python bench/bench_async_save.py
    .venv/bin/python bench/bench_async_save.py --hidden-size 768 --num-layers 12
    .venv/bin/python bench/bench_async_save.py --bf16
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import statistics
import tempfile
import time
from pathlib import Path

from megatron_h2.training.main import main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--train-iters", type=int, default=12)
    p.add_argument("--save-interval", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2,
                   help="pairs of runs (synchronous, then background; the order flips each "
                        "pair); figures are medians over the pairs")
    p.add_argument("--bf16", action="store_true",
                   help="train with --bf16 (the checkpoint holds the fp32 main weights)")
    return p.parse_args(argv)


def run(a: argparse.Namespace, folder: Path, background: bool) -> dict[str, float]:
    flags = ["--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
             "--num-attention-heads", "8", "--seq-length", "128", "--micro-batch-size", "2",
             "--global-batch-size", "4", "--lr", "1e-4", "--train-iters", str(a.train_iters),
             "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
             "--eval-iters", "0", "--log-interval", str(a.train_iters),
             "--save", str(folder), "--save-interval", str(a.save_interval),
             *(["--bf16"] if a.bf16 else [])]
    out = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out):
        assert main(flags + (["--async-save"] if background else [])) == 0
    wall = time.perf_counter() - start
    text = out.getvalue()
    if background:
        stalls = re.findall(r"in the background \(state gathered and copied to host memory in "
                            r"([\d.]+) s\)", text)
        writes = re.findall(r"written in the background in ([\d.]+) s", text)
    else:
        stalls, writes = re.findall(r"saved checkpoint at iteration \d+ to \S+ \(([\d.]+) s\)",
                                    text), []
    return {"stall": statistics.median(map(float, stalls)),
            "write": statistics.median(map(float, writes)) if writes else float("nan"),
            "wall": wall, "saves": len(stalls)}


def main_bench(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.repeats):  # alternate so that a change of machine load hits both
            for background in ((False, True) if r % 2 == 0 else (True, False)):
                folder = Path(tmp) / f"{'async' if background else 'sync'}_{r}"
                runs[background].append(run(a, folder, background))
        size = sum(f.stat().st_size for f in (Path(tmp) / "sync_0").glob("iter_*/*"))

    def med(background: bool, key: str) -> float:
        return statistics.median(x[key] for x in runs[background])

    saves = runs[False][0]["saves"]
    print(f"model hidden {a.hidden_size} x {a.num_layers} layers"
          f"{' (--bf16: fp32 main weights saved)' if a.bf16 else ''}; {saves} saves of about "
          f"{size / saves / 2**20:.0f} MiB each; medians over {a.repeats} alternating pairs")
    print(f"synchronous save: training waits {med(False, 'stall'):.3f} s per save; run "
          f"{med(False, 'wall'):.1f} s")
    print(f"--async-save:     training waits {med(True, 'stall'):.3f} s per save (write "
          f"{med(True, 'write'):.3f} s in the background); run {med(True, 'wall'):.1f} s")
    ratios = [b["stall"] / s["stall"] for s, b in zip(runs[False], runs[True])]
    walls = [f"{s['wall']:.1f}/{b['wall']:.1f} s" for s, b in zip(runs[False], runs[True])]
    print(f"stall ratio async / sync: {med(True, 'stall') / med(False, 'stall'):.2f} "
          f"(per pair: {', '.join(f'{x:.2f}' for x in ratios)}); run wall sync/async per pair: "
          f"{', '.join(walls)}")


if __name__ == "__main__":
    main_bench()
