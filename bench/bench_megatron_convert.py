"""Sizes and times of converting the distributed-optimizer fixtures Megatron-Core saved at DP 2,
TP 2, PP 2 and TP 2 x PP 2 x DP 2 (tests/fixtures/megatron/*_distopt_*) and the
mixture-of-experts ones saved at EP 1 and EP 2 (moe_ep*): Megatron-LM ->
megatron_h2 with ``tools/convert_checkpoint.py``, and back to a Megatron-LM ``torch_dist``
checkpoint at the saved TP / PP (vocabulary padded as saved). Each conversion runs
``--repeats`` times in this process; prints the median and worst wall time and the
directories' sizes.

    python bench/bench_megatron_convert.py [--repeats 5] [--fixtures moe_ep1 moe_ep2]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from megatron_h2.commands.convert_checkpoint import main as convert

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "megatron"
LAYOUTS = {"gpt_distopt_dp2": (1, 1), "llama_distopt_tp2": (2, 1), "gpt_distopt_pp2": (1, 2),
           "gpt_distopt_tp2_pp2_dp2": (2, 2), "moe_ep1": (1, 1), "moe_ep2": (1, 1)}


def size_kib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1024


def timed(argv: list[str], output: Path, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        shutil.rmtree(output, ignore_errors=True)
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            assert convert(argv) == 0, argv
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fixtures", nargs="+", choices=sorted(LAYOUTS), default=list(LAYOUTS))
    options = parser.parse_args()
    repeats = options.repeats
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
          f"{repeats} repeats each")
    print(f"{'fixture':24} {'format':15} {'to':12} {'in KiB':>8} {'out KiB':>8} "
          f"{'median s':>9} {'worst s':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in options.fixtures:
            tp, pp = LAYOUTS[name]
            for fmt in ("torch_dist" if name.startswith("moe") else "dp_reshardable", "torch"):
                src = FIXTURES / name / fmt
                ours = Path(tmp) / f"{name}_{fmt}_h2"
                back = Path(tmp) / f"{name}_{fmt}_back"
                steps = [
                    ("megatron_h2", src, ours, ["--from", "megatron", "--to", "megatron_h2"]),
                    ("megatron", ours, back, ["--from", "megatron_h2", "--to", "megatron",
                                              "--target-tensor-parallel-size", str(tp),
                                              "--target-pipeline-parallel-size", str(pp),
                                              "--make-vocab-size-divisible-by", str(64 // tp)]),
                ]
                for to, inp, out, flags in steps:
                    times = timed([*flags, "--input", str(inp), "--output", str(out)], out,
                                  repeats)
                    print(f"{name:24} {fmt:15} {to:12} {size_kib(inp):8.0f} "
                          f"{size_kib(out):8.0f} {statistics.median(times):9.3f} "
                          f"{max(times):8.3f}")


if __name__ == "__main__":
    main()
