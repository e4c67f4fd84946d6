"""What a training process costs before it trains: CPU seconds of a fresh interpreter that
imports the entry point and builds and steps an AdamW, with megatron_h2's AdamW against
``torch.optim.AdamW``.

Every rank of a launch, every test run in a subprocess, pays this once. ``torch.optim``'s
optimizers import ``torch._dynamo`` (and sympy) when built; megatron_h2's :class:`AdamW` runs
the same functional update without them, and the entry point imports
torch.distributed.checkpoint only to read or write Megatron's torch_dist format. The variants,
each a fresh ``python -c``, run in alternating order (``--repeats`` rounds):

* ``torch``: ``import torch`` alone (the floor);
* ``ours``: the entry point, a small model, megatron_h2's AdamW, one step;
* ``torch_optim``: the same with ``torch.optim.AdamW``;
* ``torch_optim_dcp``: that, plus importing torch.distributed.checkpoint (what every training
  process did before both were avoided).

Printed: each variant's median CPU seconds (user + system of the child), and the differences to
``ours``. CPU time, not wall time: the machine may be shared.

    .venv/bin/python bench/bench_process_startup.py
    .venv/bin/python bench/bench_process_startup.py --repeats 9
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys

STEP = """
import torch
from megatron_h2.training.main import main  # noqa: F401 - the entry point's imports
from megatron_h2.optimizer.adamw import AdamW, param_groups
from megatron_h2.config import OptimizerConfig
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
items = [(n, p, p) for n, p in model.named_parameters()]
opt = {cls}(param_groups(items, OptimizerConfig()), lr=1e-3, foreach=True)
model(torch.randn(8, 64)).square().sum().backward()
opt.step()
"""

VARIANTS = {
    "torch": "import torch",
    "ours": STEP.format(cls="AdamW"),
    "torch_optim": STEP.format(cls="torch.optim.AdamW"),
    "torch_optim_dcp": STEP.format(cls="torch.optim.AdamW") + "import torch.distributed.checkpoint",
}


def cpu_seconds(code: str) -> float:
    """User + system CPU seconds of one ``python -c code`` child."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="rounds of every variant")
    a = p.parse_args(argv)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for round_ in range(a.repeats):
        for name in names if round_ % 2 == 0 else names[::-1]:
            times[name].append(cpu_seconds(VARIANTS[name]))
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    ours = statistics.median(times["ours"])
    print(f"median CPU seconds of a fresh process over {a.repeats} rounds (load {load}):")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:16s} {median:6.2f} s  ({median - ours:+.2f} s against ours)  "
              f"all: {', '.join(f'{v:.2f}' for v in values)}")


if __name__ == "__main__":
    main()
