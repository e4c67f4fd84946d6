"""Cost of ``--precision-check-interval``: one check against one training iteration.

One process, one thread. A GPT model is built as the trainer builds it with the check on
(``KernelProbe`` kernels); a training iteration is ``--micro-batches`` forward / backward passes
of ``--micro-batch-size`` sequences and an AdamW step; a check is
:meth:`~megatron_h2.monitoring.precision_monitor.PrecisionMonitor.check` (the last
micro-batch re-run with every operator replayed on the CPU in fp64). They alternate for
``--rounds`` rounds after a warm-up; printed: median wall and CPU seconds of each and the ratio
check / iteration, which is how many iterations one check costs (so the overhead of
``--precision-check-interval N`` is about ratio / N). CPU time is printed beside wall time
because other processes on a shared machine inflate wall times unevenly.

    .venv/bin/python bench/bench_precision_check.py
    .venv/bin/python bench/bench_precision_check.py --hidden-size 256 --num-layers 4 --bf16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_h2.config import ModelConfig, OptimizerConfig, ParallelConfig, TrainingConfig
from megatron_h2.devices import get_accelerator
from megatron_h2.devices.op_replay import KernelProbe
from megatron_h2.distributed.topology import build_topology
from megatron_h2.models.gpt import GPTModel, init_parameters
from megatron_h2.monitoring.precision_monitor import PrecisionMonitor
from megatron_h2.optimizer.adamw import build_optimizer
from megatron_h2.training.layout import uniform_plan


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-layers", type=int, default=6)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--ffn-hidden-size", type=int, default=128)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=7)
    return p.parse_args(argv)


def timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    acc = get_accelerator(args.device)
    model_cfg = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                            num_attention_heads=args.num_attention_heads,
                            ffn_hidden_size=args.ffn_hidden_size, seq_length=args.seq_length,
                            vocab_size=args.vocab_size)
    probe = KernelProbe(acc.kernels)
    model = GPTModel(model_cfg, probe.kernels).to(acc.device)
    init_parameters(model, model_cfg, 1)
    optimizer = build_optimizer(model, OptimizerConfig(), acc.kernels)
    training = TrainingConfig(micro_batch_size=args.micro_batch_size,
                              global_batch_size=args.micro_batch_size * args.micro_batches)
    topo = build_topology(uniform_plan(ParallelConfig(), model_cfg, training, 1, args.device),
                          0, 1)
    monitor = PrecisionMonitor(model, probe, acc, topo, args.bf16, seed=1)
    gen = torch.Generator().manual_seed(0)
    b, s = args.micro_batch_size, args.seq_length

    def iteration() -> None:
        optimizer.zero_grad()
        for _ in range(args.micro_batches):
            batch = torch.randint(0, args.vocab_size, (b, s + 1), generator=gen).to(acc.device)
            with acc.autocast(args.bf16):
                loss = model(tokens=batch[:, :-1], labels=batch[:, 1:]).mean()
            (loss / args.micro_batches).backward()
        optimizer.step()
        acc.synchronize()

    def check() -> None:
        monitor.check()
        acc.synchronize()

    iteration(), check()  # warm-up
    runs: dict[str, list[tuple[float, float]]] = {"iteration": [], "check": []}
    for r in range(args.rounds):
        order = ("iteration", "check") if r % 2 == 0 else ("check", "iteration")
        for name in order:
            runs[name].append(timed(iteration if name == "iteration" else check))
    print(f"precision check vs training iteration: {args.num_layers} layers, hidden "
          f"{args.hidden_size}, seq {s}, micro-batch {b} x {args.micro_batches}, "
          f"{'bf16' if args.bf16 else 'fp32'}, device {args.device}, {args.rounds} rounds, "
          f"torch {torch.__version__}")
    med = {name: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
           for name, v in runs.items()}
    for name, (wall, cpu) in med.items():
        print(f"  {name:<9} wall {wall * 1e3:8.1f} ms   cpu {cpu * 1e3:8.1f} ms")
    print(f"  one check = {med['check'][0] / med['iteration'][0]:.2f} iterations (wall), "
          f"{med['check'][1] / med['iteration'][1]:.2f} iterations (cpu)")


if __name__ == "__main__":
    main()
