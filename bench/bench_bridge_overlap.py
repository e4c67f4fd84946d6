"""How much of the pipeline bridge's time is hidden behind compute: PP=2, bridge forced, CPU.

Two gloo processes (``tests/helpers/dist_utils.run_distributed``, one thread each) build their stage
as ``bench_parallel.py`` does (plan, topology, stage ``GPTModel``, optimizer, synthetic corpus) and
run real ``StepRunner.train_step`` calls with ``force_bridge`` (every stage boundary crosses
:class:`~megatron_h2.distributed.bridge.Bridge`), once per wire dtype (fp32, bf16). Each round runs,
in rotating order, one step per (wire dtype, mode):

* ``async`` (a): the library as it is; sends are posted and completed later (reaped at the next
  call or by ``PipeComm.wait_sends`` at the end of the step);
* ``sync`` (b): every send completed right after it is posted. The bench wraps the bridge's
  ``post`` on its instance (no library change) so that each send handle is waited for before
  ``post`` returns, i.e. before the receive of the same call is waited for.

The same instance wrappers time, in both modes, every ``Bridge._isend`` (entry, the moment its
isends are issued after the cast, exit), every irecv and receive wait, every ``exchange`` call
and every ``wait_sends``, with ``time.perf_counter`` (one system-wide monotonic clock on Linux,
so the two ranks' timestamps are compared directly), and ``PipeComm.stats()`` gives
``bridge_send_wait_s`` / ``bridge_recv_wait_s`` per step. Messages are matched across ranks in
order (activations 0 -> 1, gradients 1 -> 0). After the steps of a round, one message each way
is sent with the receiver's irecv already posted (``isolated``: the bridge's cost for one
message when nothing else runs).

Figures (per step, both ranks summed, medians over rounds):

* ``S_b``: time inside send calls in mode (b): ``_isend`` + immediate wait. The wait includes
  the time the receiver had not yet posted its receive: gloo moves no data before the irecv is
  posted, so a completed send needs the peer; that part (``peer``, from the cross-rank
  timestamps) is pipeline dependency, not transfer. ``X_b = S_b - peer``: the sends' transfer.
* ``E_a``: exposed send time in mode (a): ``_isend`` + ``bridge_send_wait_s`` (reaping and
  ``wait_sends``).
* hidden share (sender side) = ``1 - E_a / X_b``; the brief's ``1 - E_a / S_b`` is printed too
  (inflated by ``peer``); also per direction (activations 0 -> 1, gradients 1 -> 0).
  Cross-check: ``(T_b - T_a) / X_b`` (and ``/ S_b``), T = iteration, paired rounds.
* wire time of a message: from both sides posted (``max(isend issued, irecv posted)``) until the
  receive wait returned; the table gives its sum and the share of it during which the receiver
  and the sender were blocked in a pipeline call (not computing).

    .venv/bin/python bench/bench_bridge_overlap.py                  # fp32 and bf16, ~2-3 min
    .venv/bin/python bench/bench_bridge_overlap.py --hidden-size 1024 --rounds 3 --json r.jsonl
    .venv/bin/python bench/bench_bridge_overlap.py --wire bf16 --staged --chunk-mb 0.25
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the spawned ranks

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# the test helpers (tests/helpers/dist_utils.py) are no part of the installed package: the
# repository root goes on sys.path for them
sys.path.insert(0, str(ROOT))

from bench_parallel import LR, WORLD, Rank, build_rank, make_corpus, run_config  # noqa: E402

from megatron_h2.config import ParallelConfig  # noqa: E402
from megatron_h2.distributed.p2p import PipeComm  # noqa: E402
from megatron_h2.training.step import StepRunner  # noqa: E402
from tests.helpers.dist_utils import run_distributed  # noqa: E402

MODES = ("async", "sync")
now = time.perf_counter
med = statistics.median


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for flag, default in (("num-layers", 2), ("hidden-size", 512), ("num-attention-heads", 8),
                          ("seq-length", 256), ("micro-batch-size", 2), ("vocab-size", 256),
                          ("micro-batches", 8)):
        p.add_argument("--" + flag, type=int, default=default)
    p.add_argument("--wire", default="fp32,bf16", help="wire dtypes, comma separated")
    p.add_argument("--chunk-mb", type=float, default=4.0, help="bridge chunk size (MiB)")
    p.add_argument("--staged", action="store_true",
                   help="send through host buffers and the stager thread (the accelerator path)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket MiB")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--rounds", type=int, default=20, help="timed rounds (at most)")
    p.add_argument("--max-seconds", type=float, default=100.0,
                   help="stop the timed rounds after this long (0: no limit)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", metavar="FILE", default=None, help="append one JSON line")
    a = p.parse_args(argv)
    a.wire = [w.strip() for w in a.wire.split(",") if w.strip()]
    if not a.wire or set(a.wire) - {"fp32", "bf16"}:
        p.error("--wire takes fp32 and/or bf16")
    return a


# ----------------------------------------------------------------------------- probe
class BridgeProbe:
    """Instance wrappers on one rank's PipeComm and its bridge (the library is unchanged).

    Per message sent: entry into ``Bridge._isend``, the moment its isends are issued (after the
    cast: the last ``_chunks`` call inside it), its exit and, with ``sync``, when the send
    completed; per message received: the irecv posted, the wait's start and end. Also every
    pipeline call (``exchange``) and ``wait_sends``, i.e. the intervals the rank is not
    computing. ``sync`` waits for each send handle before ``post`` returns.
    """

    def __init__(self, comm: PipeComm) -> None:
        sides = [s for s in (comm.prev, comm.next) if s is not None]
        if len(sides) != 1 or sides[0].link.kind != "bridge":
            raise RuntimeError(f"expected one bridged boundary per rank, got {comm.paths}")
        self.comm, link, self.sync = comm, sides[0].link, False
        self.link, self._chunk_t = link, 0.0
        self._post, link.post = link.post, self._timed_post
        self._isend, link._isend = link._isend, self._timed_isend
        self._irecv, link._irecv = link._irecv, self._timed_irecv
        self._chunks, link._chunks = link._chunks, self._timed_chunks
        self._exchange, comm.exchange = comm.exchange, self._timed_exchange
        self._wait_sends, comm.wait_sends = comm.wait_sends, self._timed_wait_sends
        self.reset()

    def reset(self) -> None:
        """New record lists (the previous ones stay with whoever took them) and link stats."""
        self.sends: list[dict] = []
        self.recvs: list[dict] = []
        self.calls: list[tuple[float, float]] = []  # pipeline calls and wait_sends
        self.comm.reset_stats()

    def _timed_chunks(self, flat):
        self._chunk_t = now()
        return self._chunks(flat)

    def _timed_isend(self, tensor, peer):
        t0 = now()
        handle = self._isend(tensor, peer)
        self.sends.append({"t0": t0, "issue": self._chunk_t, "t1": now(), "done": None})
        return handle

    def _timed_irecv(self, shape, dtype, peer):
        rec = {"t0": now(), "wait0": None, "wait1": None}
        handle = self._irecv(shape, dtype, peer)
        handle.wait = _timed_wait(handle.wait, rec)  # instance attribute, this handle only
        self.recvs.append(rec)
        return handle

    def _timed_post(self, sends, recvs):
        first = len(self.sends)
        send_handles, recv_handles = self._post(sends, recvs)
        if self.sync:
            for handle, rec in zip(send_handles, self.sends[first:]):
                handle.wait()  # counted in bridge_send_wait_s as well
                rec["done"] = now()
        return send_handles, recv_handles

    def _timed_exchange(self, *args, **kwargs):
        t0 = now()
        try:
            return self._exchange(*args, **kwargs)
        finally:
            self.calls.append((t0, now()))

    def _timed_wait_sends(self) -> None:
        t0 = now()
        self._wait_sends()
        self.calls.append((t0, now()))


def _timed_wait(inner, rec: dict):
    def wait():
        rec["wait0"] = now()
        out = inner()
        rec["wait1"] = now()
        return out
    return wait


# ----------------------------------------------------------------------------- worker
def make_runner(r: Rank, a: argparse.Namespace, wire: str) -> StepRunner:
    """A StepRunner whose PipeComm sends every boundary through the bridge with ``wire``."""
    topo = r.topo
    cfg = run_config(a, topo.pp_size, a.micro_batches * a.micro_batch_size * topo.dp_size)
    cfg = dataclasses.replace(cfg, parallel=ParallelConfig(
        pipeline_model_parallel_size=topo.pp_size, force_bridge=True, bridge_dtype=wire,
        bridge_chunk_mb=a.chunk_mb))
    tp = topo.tp_context(cfg.parallel.sequence_parallel)
    return StepRunner(cfg, r.acc, topo, tp, r.model, r.optimizer)


def timed_step(r: Rank, runner: StepRunner, probe: BridgeProbe, mode: str) -> dict:
    probe.sync = mode == "sync"
    probe.reset()
    start = r.next_start(runner)
    dist.barrier()
    t0 = now()
    runner.train_step(r.dataset, start, r.steps, LR)
    t1 = now()
    stats = runner.comm.stats()
    return {"start": t0, "end": t1, "sends": probe.sends, "recvs": probe.recvs,
            "calls": probe.calls, "send_wait_s": stats["bridge_send_wait_s"],
            "recv_wait_s": stats["bridge_recv_wait_s"], "bytes": stats["bridge_bytes"],
            "transfers": stats["bridge_transfers"], "chunks": stats["bridge_chunks"]}


def isolated(runner: StepRunner, probe: BridgeProbe, reps: int = 3) -> list[dict]:
    """One message each way, ``reps`` times, the receiver's irecv posted (and a barrier passed)
    before the sender starts; the probe's timestamps of each."""
    comm, rank = runner.comm, dist.get_rank()
    x = torch.randn(comm.shape)
    probe.reset()
    probe.sync = False
    out = []
    for sender in (0, 1) * reps:
        peer = 1 - rank
        recv_handles = []
        if rank != sender:
            _, recv_handles = probe.link.post([], [(comm.shape, comm.dtype, peer)])
        dist.barrier()
        if rank == sender:
            send_handles, _ = probe.link.post([(x, peer)], [])
            for h in send_handles:
                h.wait()
            out.append({"sender": sender, **probe.sends[-1]})
        else:
            for h in recv_handles:
                h.wait()
            out.append({"sender": sender, **probe.recvs[-1]})
        dist.barrier()
    probe.reset()
    return out


def worker(rank: int, world: int, a: argparse.Namespace, prefix: str) -> dict:
    r = build_rank(a, rank, pp=world, prefix=prefix)
    runners = {w: make_runner(r, a, w) for w in a.wire}
    probes = {w: BridgeProbe(runners[w].comm) for w in a.wire}
    if a.staged:
        for probe in probes.values():
            probe.link.staged = True  # host copies + stager thread, as off the CPU
    variants = [(w, m) for w in a.wire for m in MODES]
    records: dict[str, list] = {f"{w}/{m}": [] for w, m in variants}
    iso: dict[str, list] = {w: [] for w in a.wire}
    began = None
    for i in range(a.warmup + a.rounds):
        if i == a.warmup:
            began = now()
        k = i % len(variants)
        round_recs = {}
        for w, m in variants[k:] + variants[:k]:
            round_recs[f"{w}/{m}"] = timed_step(r, runners[w], probes[w], m)
        round_iso = {w: isolated(runners[w], probes[w]) for w in a.wire}
        if i >= a.warmup:
            for key, rec in round_recs.items():
                records[key].append(rec)
            for w in a.wire:
                iso[w].append(round_iso[w])
            stop = torch.tensor([float(a.max_seconds > 0 and now() - began > a.max_seconds)])
            dist.broadcast(stop, src=0)  # both ranks run the same number of rounds
            if stop.item():
                break
    for runner in runners.values():
        runner.comm.close()
    return {"stage": r.topo.stage, "params": sum(p.numel() for p in r.model.parameters()),
            "shape": list(runners[a.wire[0]].comm.shape), "records": records, "iso": iso}


# ----------------------------------------------------------------------------- analysis
def _overlap(lo: float, hi: float, intervals: list[tuple[float, float]]) -> float:
    """Seconds of [lo, hi] covered by ``intervals`` (which do not overlap each other)."""
    return sum(max(0.0, min(hi, b) - max(lo, a)) for a, b in intervals)


def analyse_step(recs: list[dict]) -> dict:
    """One step of one variant; ``recs[rank]``. Rank 0 is stage 0 (sends activations)."""
    post = sum(s["t1"] - s["t0"] for rec in recs for s in rec["sends"])
    cast = sum(s["issue"] - s["t0"] for rec in recs for s in rec["sends"])
    send_wait = sum(rec["send_wait_s"] for rec in recs)
    recv_wait = sum(rec["recv_wait_s"] for rec in recs)
    peer = wire = rx_blocked = tx_blocked = sync_wait = 0.0
    messages = 0
    by_dir: dict[str, float] = {}
    for src, name in ((0, "act"), (1, "grad")):
        dst, peer_before = 1 - src, peer
        sends, recvs = recs[src]["sends"], recs[dst]["recvs"]
        if len(sends) != len(recvs):
            raise RuntimeError(f"rank {src} sent {len(sends)} messages, rank {dst} received "
                               f"{len(recvs)}")
        for s, rv in zip(sends, recvs):
            messages += 1
            end = s["t1"] if s["done"] is None else s["done"]  # the sender let go of it
            if s["done"] is not None:
                sync_wait += s["done"] - s["t1"]
            # the sender blocked on this send before the irecv was posted: waiting for the peer
            peer += min(max(0.0, rv["t0"] - s["issue"]), end - s["issue"])
            lo, hi = max(s["issue"], rv["t0"]), rv["wait1"]
            if hi > lo:
                wire += hi - lo
                rx_blocked += _overlap(lo, hi, recs[dst]["calls"])
                tx_blocked += _overlap(lo, hi, recs[src]["calls"])
        calls = (sum(x["t1"] - x["t0"] for x in sends) + recs[src]["send_wait_s"])
        by_dir[f"S_{name}"] = calls
        by_dir[f"X_{name}"] = calls - (peer - peer_before)
    return {"T": max(r["end"] for r in recs) - min(r["start"] for r in recs),
            "post": post, "cast": cast, "send_wait": send_wait, "sync_wait": sync_wait,
            "send_calls": post + send_wait, "peer": peer, "transfer": post + send_wait - peer,
            "recv_wait": recv_wait, "wire": wire, "rx_blocked": rx_blocked,
            "tx_blocked": tx_blocked, "messages": messages,
            "bytes": sum(r["bytes"] for r in recs), "chunks": sum(r["chunks"] for r in recs),
            **by_dir}


def analyse_iso(by_rank: list[list[list[dict]]]) -> dict:
    """Isolated messages: sender post start -> receiver wait end (cast, wire, cast back)."""
    full, post = [], []
    for rnd0, rnd1 in zip(*by_rank):
        for x0, x1 in zip(rnd0, rnd1):
            s, rv = (x0, x1) if x0["sender"] == 0 else (x1, x0)
            full.append(rv["wait1"] - s["t0"])
            post.append(s["t1"] - s["t0"])
    return {"message_s": med(full), "post_s": med(post), "samples": len(full)}


def summarize(results: list[dict], wire: str) -> dict:
    steps = {}
    for mode in MODES:
        key = f"{wire}/{mode}"
        per_round = [analyse_step(list(recs)) for recs in zip(*(r["records"][key]
                                                               for r in results))]
        steps[mode] = {"rounds": per_round,
                       **{k: med([x[k] for x in per_round]) for k in per_round[0]}}
    a, b = steps["async"], steps["sync"]
    iso = analyse_iso([r["iso"][wire] for r in results])
    diffs = [rb["T"] - ra["T"] for ra, rb in zip(a["rounds"], b["rounds"])]
    exposed = a["send_calls"]
    return {"wire": wire, "async": a, "sync": b, "isolated": iso,
            "S_b": b["send_calls"], "X_b": b["transfer"], "E_a": exposed,
            "hidden_share": 1 - exposed / b["transfer"] if b["transfer"] > 0 else float("nan"),
            "hidden_share_raw": 1 - exposed / b["send_calls"],
            **{f"hidden_share_{d}": 1 - a[f"S_{d}"] / b[f"X_{d}"] if b[f"X_{d}"] > 0
               else float("nan") for d in ("act", "grad")},
            "T_diff_paired": med(diffs), "T_diff_rounds": diffs,
            "T_spread": max(x["T"] for x in a["rounds"]) - min(x["T"] for x in a["rounds"]),
            "crosscheck": med(diffs) / b["transfer"] if b["transfer"] > 0 else float("nan"),
            "crosscheck_raw": med(diffs) / b["send_calls"],
            "rx_blocked_share": a["rx_blocked"] / a["wire"] if a["wire"] else float("nan"),
            "tx_blocked_share": a["tx_blocked"] / a["wire"] if a["wire"] else float("nan")}


# ----------------------------------------------------------------------------- output
def ms(seconds: float, width: int = 9) -> str:
    return f"{seconds * 1e3:{width}.2f}"


def print_table(s: dict, shape: list[int], rounds: int) -> None:
    a, b, iso = s["async"], s["sync"], s["isolated"]
    n, chunks = int(a["messages"]), int(a["chunks"])
    nbytes = a["bytes"] / max(1, n)
    print(f"\nwire {s['wire']}: {n} messages per step ({n // 2} activations + {n // 2} "
          f"gradients of {shape}), {nbytes / 2**20:.2f} MiB each on the wire, {chunks} chunks; "
          f"{rounds} rounds; ms per step, both ranks summed, median of each row")
    print(f"  one message alone (irecv already posted): {ms(iso['message_s'], 0)} ms "
          f"(of it in the send call {ms(iso['post_s'], 0)}) -> x {n} = "
          f"{ms(iso['message_s'] * n, 0)} ms per step")
    print(f"  {'':50s}async (a)  sync (b)")
    rows = (("iteration T (first start to last end)", "T"),
            ("send calls: cast + isend (post)", "post"),
            ("  of it before the isend (cast, Python)", "cast"),
            ("send calls: blocked completing sends", "send_wait"),
            ("send calls, total (S)", "send_calls"),
            ("  of it before the receiver posted (peer)", "peer"),
            ("  S - peer (transfer on the sending side, X)", "transfer"),
            ("receive waits (incl. waiting for the peer)", "recv_wait"),
            ("wire time (both posted -> receive returned)", "wire"),
            ("  of it the receiver was blocked", "rx_blocked"),
            ("  of it the sender was blocked", "tx_blocked"))
    for label, key in rows:
        print(f"  {label:48s}{ms(a[key])} {ms(b[key])}")
    print(f"  E_a = S(a) = {ms(s['E_a'], 0)} | S_b = {ms(s['S_b'], 0)} | X_b = "
          f"{ms(s['X_b'], 0)}")
    print(f"  hidden share, sending side = 1 - E_a / X_b = {100 * s['hidden_share']:.0f}%   "
          f"[1 - E_a / S_b = {100 * s['hidden_share_raw']:.0f}%: counts waiting for the peer "
          "as bridge time]")
    print(f"    by direction: activations (stage 0 -> 1) 1 - {ms(a['S_act'], 0)} / "
          f"{ms(b['X_act'], 0)} = {100 * s['hidden_share_act']:.0f}%, gradients (1 -> 0) "
          f"1 - {ms(a['S_grad'], 0)} / {ms(b['X_grad'], 0)} = {100 * s['hidden_share_grad']:.0f}%")
    print(f"  wire time overlapped with compute: sender {100 * (1 - s['tx_blocked_share']):.0f}%"
          f", receiver {100 * (1 - s['rx_blocked_share']):.0f}% (a)")
    print(f"  cross-check: T_b - T_a = {ms(s['T_diff_paired'], 0)} ms (median of paired rounds: "
          f"{', '.join(ms(d, 0) for d in s['T_diff_rounds'])}) -> / X_b = "
          f"{100 * s['crosscheck']:.0f}%, / S_b = {100 * s['crosscheck_raw']:.0f}%; spread of "
          f"T(a) over rounds {ms(s['T_spread'], 0)} ms")


def print_legend() -> None:
    print("""
What the numbers are (per training step, both ranks added up):
  (a) async: sends as in the library; (b) sync: each send waited for right after it is posted.
  post: inside Bridge._isend: cast to the wire dtype, then the chunks' isend. On the CPU, gloo
    writes the whole message inside isend when the receiver's irecv is already posted, and
    returns at once (the data moves later, from gloo's thread) when it is not.
  blocked completing sends: PipeComm.stats() bridge_send_wait_s; (b) the wait after each post,
    (a) reaping and wait_sends at the end of the step.
  peer: the part of the send calls before the receiver had posted its irecv. gloo moves no data
    until then, so this is waiting for the other stage's compute (pipeline dependency), not
    bridge time; in (a) the same wait shows up as a receive wait instead.
  X = S - peer: the bridge's cost to the sender. X_b (sync) is that cost with nothing hidden;
    E_a = S(a) is what the sender still spends in send calls with asynchronous sends.
  hidden share, sending side = 1 - E_a / X_b.
  wire time: per message, from both ends posted (isend issued, irecv posted) until the
    receive wait returned (with the cast back for bf16). "blocked" = inside a pipeline call or
    wait_sends, i.e. not computing. The receiver is blocked for all of it by construction:
    PipeComm posts an irecv only when it needs the data, and gloo starts a transfer only once
    the irecv is posted, so nothing is hidden on the receiving side.
  cross-check: T_b - T_a, the iteration time asynchronous sends actually save (paired rounds),
    against X_b; compare it with the spread of T over rounds before reading anything into it.""")


def print_header(a: argparse.Namespace, params: list[int]) -> None:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"torch {torch.__version__} | {platform.machine()} | {os.cpu_count()} CPUs, load "
          f"average {load} | {WORLD} gloo processes, 1 thread each")
    print(f"PP=2, force_bridge, chunk {a.chunk_mb} MiB{', staged' if a.staged else ''} | "
          f"{a.num_layers} layers, hidden {a.hidden_size}, heads {a.num_attention_heads}, seq "
          f"{a.seq_length}, micro-batch {a.micro_batch_size}, {a.micro_batches} micro-batches, "
          f"vocab {a.vocab_size}, fp32 compute | stage parameters "
          f"{params[0] / 1e6:.2f}M / {params[1] / 1e6:.2f}M")
    print("each round: one step per (wire dtype, mode) in rotating order, then isolated "
          "messages; (a) async sends as in the library, (b) each send completed inside post")
    if os.getloadavg()[0] > 0.5 * (os.cpu_count() or 1):
        print("warning: the machine is already busy; other processes share the cores")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    t = now()
    with tempfile.TemporaryDirectory() as tmp:
        prefix = make_corpus(tmp, a.vocab_size, a.seed)
        results = run_distributed(worker, WORLD, a, prefix, timeout=900)
    results.sort(key=lambda r: r["stage"])
    print_header(a, [r["params"] for r in results])
    rounds = len(results[0]["records"][f"{a.wire[0]}/async"])
    summaries = [summarize(results, w) for w in a.wire]
    for s in summaries:
        print_table(s, results[0]["shape"], rounds)
    print_legend()
    print("\nsummary: " + "; ".join(
        f"{s['wire']}: sending side hides {100 * s['hidden_share']:.0f}% of X_b "
        f"{ms(s['X_b'], 0)} ms, receiving side {100 * (1 - s['rx_blocked_share']):.0f}%, "
        f"T(a) {ms(s['async']['T'], 0)} ms, T(b) - T(a) {ms(s['T_diff_paired'], 0)} ms"
        for s in summaries) + f" | took {now() - t:.0f} s")
    if a.json:
        report = {"config": vars(a), "torch": torch.__version__, "cpus": os.cpu_count(),
                  "load_average": os.getloadavg(), "shape": results[0]["shape"],
                  "results": summaries}
        with open(a.json, "a") as fh:
            fh.write(json.dumps(report) + "\n")
        print(f"results appended to {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
