"""Cross-vendor bridge throughput against plain gloo send/recv of the same tensors.

Two processes on this machine, one gloo group. For every size, each variant moves ``--reps``
tensors from rank 0 to rank 1 and rank 1 answers with a one-element ack; rank 0 times the whole
exchange. Variants:

* ``plain``: ``dist.send`` / ``dist.recv`` of the fp32 tensor, one message, blocking, into a
  fresh buffer per transfer (a pipeline receive needs one: the activation is kept for backward);
* ``plain reuse``: the same into one reused buffer (a lower bound on the receive cost);
* ``bridge fp32 / chunk C``: :class:`~megatron_h2.distributed.bridge.Bridge` with ``chunk_mb=C``
  (asynchronous chunked isend / irecv, staged through host buffers off the CPU) over the gloo
  transport;
* ``bridge bf16 / chunk C``: the same with the bf16 wire dtype (half the bytes on the wire);
* ``nixl fp32 / chunk C``, ``nixl bf16 / chunk C`` (``--transports gloo nixl``): the same
  bridge over the NIXL transport (:mod:`~megatron_h2.distributed.nixl_transport`; built once
  per chunk size before timing). ``--ucx-tls`` sets ``UCX_TLS`` for it (default ``tcp``, like
  gloo; ``--ucx-tls ''`` lets UCX pick, e.g. shared memory between processes of one host).

Variants are measured alternately in every round (the order flips each round) and the median
over rounds is printed: GB/s of the fp32 payload (what the pipeline moves; the bf16 wire carries
half of it), and the ratio bridge / plain (median of the per-round ratios). Printed, not
asserted. ``--staged`` also routes CPU tensors through the host-buffer copy and the stager thread
(the accelerator path); ``--device cuda`` runs the bridge from GPU memory (one GPU per rank
where there are two, else both on GPU 0).

    .venv/bin/python bench/bench_bridge.py
    .venv/bin/python bench/bench_bridge.py --sizes 1 16 --chunks 1 4 16 --rounds 9 --staged
    .venv/bin/python bench/bench_bridge.py --transports gloo nixl --chunks 1 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_h2.distributed.bridge import Bridge, BridgeConfig
from megatron_h2.distributed.transport import Transport, make_transport

MIB = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=float, nargs="+", default=[1, 4, 16, 64],
                   help="tensor sizes in MiB of fp32 payload")
    p.add_argument("--chunks", type=float, nargs="+", default=[1, 4, 16],
                   help="bridge chunk sizes in MiB")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=0,
                   help="transfers per measurement (0: about 64 MiB worth, at least 2)")
    p.add_argument("--no-bf16", action="store_true", help="skip the bf16 wire variants")
    p.add_argument("--staged", action="store_true",
                   help="stage CPU tensors through host buffers and the stager thread")
    p.add_argument("--device", default="cpu", help="bridge device: cpu or cuda")
    p.add_argument("--transports", nargs="+", default=["gloo"], choices=["gloo", "nixl"],
                   help="transports under the bridge to measure (default gloo)")
    p.add_argument("--ucx-tls", default="tcp",
                   help="UCX_TLS for the nixl transport (default tcp; '' lets UCX choose)")
    return p.parse_args(argv)


Variant = tuple[str, str, BridgeConfig | None]  # (name, transport, config)


def variants(args: argparse.Namespace) -> list[Variant]:
    out: list[Variant] = [("plain", "gloo", None), ("plain reuse", "gloo", None)]
    for transport in args.transports:
        label = "bridge" if transport == "gloo" else transport
        for dtype in ([torch.float32] if args.no_bf16 else [torch.float32, torch.bfloat16]):
            for chunk in args.chunks:
                name = f"{label} {'bf16' if dtype == torch.bfloat16 else 'fp32'} / chunk {chunk:g}"
                out.append((name, transport, BridgeConfig(
                    force=True, dtype=None if dtype == torch.float32 else dtype, chunk_mb=chunk)))
    return out


class _Kept:
    """A transport shared by many measurements: the bridge's close() leaves it open."""

    def __init__(self, transport: Transport) -> None:
        self.inner, self.name = transport, transport.name
        self.isend, self.irecv = transport.isend, transport.irecv

    def close(self) -> None:
        pass


def build_transports(rank: int, args: argparse.Namespace) -> dict[tuple[str, float], _Kept]:
    """One transport per (transport, chunk size), built in the same order on both ranks."""
    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls
    out = {}
    for name in args.transports:
        for chunk in args.chunks:
            slot = BridgeConfig(chunk_mb=chunk).chunk_elements(1)
            out[(name, chunk)] = _Kept(make_transport(name, None, rank, [1 - rank], slot,
                                                      f"bench{chunk:g}", 600.0))
    return out


def measure(rank: int, config: BridgeConfig | None, tensor: torch.Tensor, reps: int,
            device: torch.device, staged: bool, reuse: bool = False,
            transport: Transport | None = None) -> float:
    """Seconds (on rank 0) to move ``reps`` copies of ``tensor`` to rank 1 and get an ack."""
    ack = torch.zeros(1)
    bridge = None
    if config is not None:
        bridge = Bridge(None, device, config, staged=staged or None, transport=transport)
    src = tensor if config is None else tensor.to(device)
    dist.barrier()
    start = time.perf_counter()
    if rank == 0:
        if bridge is None:
            for _ in range(reps):
                dist.send(src, 1)
        else:
            handles = [h for _ in range(reps) for h in bridge.post([(src, 1)], [])[0]]
            for h in handles:
                h.wait()
        dist.recv(ack, 1)
    else:
        if bridge is None:
            buf = torch.empty_like(tensor)
            for _ in range(reps):
                dist.recv(buf if reuse else torch.empty_like(tensor), 0)
        else:
            for _ in range(reps):
                out = bridge.post([], [(tuple(tensor.shape), tensor.dtype, 0)])[1][0].wait()
            if out.device.type != "cpu":
                torch.accelerator.synchronize()
        dist.send(ack, 0)
    elapsed = time.perf_counter() - start
    if bridge is not None:
        bridge.close()
    return elapsed


def worker(rank: int, init_file: str, args: argparse.Namespace, queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=timedelta(minutes=5))
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    transports = build_transports(rank, args)
    results: list[tuple[float, str, int, float]] = []  # (size, variant, round, seconds)
    for size in args.sizes:
        tensor = torch.randn(int(size * MIB) // 4)
        reps = args.reps or max(2, int(64 // size))
        names = variants(args)

        def run(transport: str, config: BridgeConfig | None, n: int, reuse: bool,
                tensor: torch.Tensor = tensor) -> float:
            link = None if config is None else transports[(transport, config.chunk_mb)]
            return measure(rank, config, tensor, n, device, args.staged, reuse, link)

        for _, transport, config in names:  # warm-up
            run(transport, config, 1, False)
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for name, transport, config in order:
                seconds = run(transport, config, reps, name == "plain reuse")
                results.append((size, name, r, seconds / reps))
    for kept in transports.values():
        kept.inner.close()
    queue.put((rank, results))
    dist.destroy_process_group()


def report(args: argparse.Namespace, results: list[tuple[float, str, int, float]]) -> None:
    print(f"bridge vs plain gloo send/recv, 2 processes, device {args.device}"
          f"{', staged' if args.staged else ''}, {args.rounds} alternating rounds, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, transports "
          f"{' '.join(args.transports)}"
          f"{f' (UCX_TLS={args.ucx_tls})' if 'nixl' in args.transports else ''}")
    print(f"{'size MiB':>8}  {'variant':<24} {'GB/s':>7} {'x plain':>8}")
    for size in args.sizes:
        rows = [r for r in results if r[0] == size]
        plain = {rnd: sec for _, name, rnd, sec in rows if name == "plain"}
        for name, _, _ in variants(args):
            secs = [sec for _, n, _, sec in rows if n == name]
            ratios = [plain[rnd] / sec for _, n, rnd, sec in rows if n == name]
            gbps = size * MIB / statistics.median(secs) / 1e9
            ratio = "" if name == "plain" else \
                f"{statistics.median(ratios):8.2f}"
            print(f"{size:8g}  {name:<24} {gbps:7.2f} {ratio:>8}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=worker, args=(r, init_file, args, queue)) for r in range(2)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=3600) for _ in procs)
        for p in procs:
            p.join()
    report(args, results[0])


if __name__ == "__main__":
    main()
