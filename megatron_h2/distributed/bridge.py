"""Transports for pipeline point-to-point traffic: the host-staged bridge and the direct path.

Neighbouring stages on chips of different vendors cannot use each other's collective library
(NCCL, HCCL, ...). Their traffic crosses the :class:`Bridge`::

    device tensor -> (cast to the wire dtype) -> pinned host buffer -> chunks over a transport
    -> host buffer -> device tensor -> (cast back to the activation dtype)

The transport (:mod:`~megatron_h2.distributed.transport`) carries the chunks: gloo isend /
irecv by default, or a transfer library such as NIXL, chosen per pair of chip types by the plan.

Each chunk (``chunk_mb``, default 4 MiB) is its own ``isend`` / ``irecv``, so on an accelerator
the device-to-host copy of chunk ``c + 1`` overlaps the wire time of chunk ``c``, and the
host-to-device copy of chunk ``c`` overlaps the arrival of chunk ``c + 1``. Sends are
asynchronous: ``post`` returns :class:`SendHandle` s at once (on an accelerator a per-bridge
stager thread waits for the staging copies and posts the chunks), so the caller computes the next
micro-batch while this one is on the wire. Pinned memory is used only where the device is not
the CPU; on the CPU the tensor itself is sent when no cast is needed.

Neighbours on the same device type use :class:`DirectLink`: ``torch.distributed`` P2P on the
default process group (the chip's own library), device tensors, no staging, no chunking.

Both expose ``post(sends, recvs) -> (send handles, recv handles)``; receives are posted before
sends. Statistics accumulate in a :class:`LinkStats` shared by every link of one kind.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from megatron_h2.distributed.transport import GlooTransport, Transport, Work
from megatron_h2.errors import ConfigError

MIB = 1 << 20

# (tensor to send, destination global rank)
SendSpec = tuple[torch.Tensor, int]
# (shape, dtype the caller wants the data in, source global rank)
RecvSpec = tuple[tuple[int, ...], torch.dtype, int]


@dataclass(frozen=True)
class BridgeConfig:
    """How cross-vendor boundaries are crossed.

    ``force`` routes every stage boundary through the bridge (exercises the cross-vendor path
    where every chip is the same); ``dtype`` (e.g. ``torch.bfloat16``) is the wire dtype, cast
    on the sender and back to the activation dtype on the receiver (None: no cast);
    ``chunk_mb`` is the size of one wire message in MiB; ``timeout_s`` bounds how long a
    transfer library's transfer may wait for its peer (gloo's own timeout is the process
    group's).
    """

    force: bool = False
    dtype: torch.dtype | None = None
    chunk_mb: float = 4.0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_mb, (int, float)) or not (
                math.isfinite(self.chunk_mb) and self.chunk_mb > 0):
            raise ConfigError(f"bridge chunk_mb must be a positive number, got {self.chunk_mb!r}")
        if self.dtype is not None and not (isinstance(self.dtype, torch.dtype)
                                           and self.dtype.is_floating_point):
            raise ConfigError(f"bridge dtype must be a floating torch dtype such as "
                              f"torch.bfloat16, got {self.dtype!r}")

    def chunk_elements(self, element_size: int) -> int:
        """Elements of ``element_size`` bytes in one chunk (at least one)."""
        return max(1, int(self.chunk_mb * MIB) // element_size)


@dataclass
class LinkStats:
    """Counters of one kind of link (bridge or direct); feed the per-interval logs."""

    bytes: int = 0  # payload bytes sent (after any cast to the wire dtype)
    bytes_recv: int = 0  # payload bytes received
    transfers: int = 0  # messages sent (one tensor piece to one peer)
    chunks: int = 0  # isend calls (== transfers on the direct path)
    send_wait_s: float = 0.0  # blocked waiting for sends to complete
    recv_wait_s: float = 0.0  # blocked waiting for receives to arrive

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)

    def as_dict(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}_{f.name}": getattr(self, f.name) for f in fields(self)}


class SendHandle:
    """An in-flight send. Holds every buffer it reads until :meth:`wait`, so none is freed or
    reused while on the wire. ``works`` is a list of requests, or a future of one (stager)."""

    def __init__(self, stats: LinkStats, works: list[Work] | Future,
                 keep: Sequence[torch.Tensor]) -> None:
        self.stats = stats
        self._works = works
        self._keep = tuple(keep)
        self.done = False

    def _resolved(self, block: bool) -> list[Work] | None:
        if isinstance(self._works, Future):
            if not block and not self._works.done():
                return None
            self._works = self._works.result()
        return self._works

    def is_completed(self) -> bool:
        """True once every chunk has left (never blocks)."""
        if self.done:
            return True
        works = self._resolved(block=False)
        return works is not None and all(w.is_completed() for w in works)

    def wait(self) -> None:
        """Block until the send has completed, then release its buffers."""
        if self.done:
            return
        start = time.perf_counter()
        for work in self._resolved(block=True):
            work.wait()
        self.stats.send_wait_s += time.perf_counter() - start
        self.done = True
        self._keep = ()


class RecvHandle:
    """A posted receive; :meth:`wait` blocks until the data is there and returns it."""

    def __init__(self, stats: LinkStats, steps: list[tuple[Work, Callable[[], object] | None]],
                 finish: Callable[[], torch.Tensor]) -> None:
        self.stats = stats
        self._steps = steps  # per request: the request, then what to do once it has arrived
        self._finish = finish
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            start = time.perf_counter()
            for work, then in self._steps:
                work.wait()
                if then is not None:
                    then()
            self.stats.recv_wait_s += time.perf_counter() - start
            self._result = self._finish()
            self._steps = []
        return self._result


def _can_pin(device: torch.device) -> bool:
    """Pinned host memory is used only for accelerators, and only where it can be allocated."""
    if device.type == "cpu":
        return False
    try:
        torch.empty(1, pin_memory=True)
    except RuntimeError:
        return False
    return True


def _host_empty(shape: Sequence[int], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=pin)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Bridge:
    """Host-staged, chunked, asynchronous transfers over a :class:`Transport`.

    ``transport`` carries the chunks (default: gloo isend / irecv on ``group``, which must then
    be a gloo group containing both ends); peers are global ranks. ``device`` is this rank's
    device: tensors handed to :meth:`post` live there, results are returned there.
    ``staged`` (default: the device is not the CPU) copies through separate host buffers and
    posts sends from the stager thread; tests set it on the CPU to exercise that path.
    """

    kind = "bridge"

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device,
                 config: BridgeConfig, stats: LinkStats | None = None,
                 staged: bool | None = None, transport: Transport | None = None) -> None:
        self.group, self.device, self.config = group, torch.device(device), config
        self.transport = transport if transport is not None else GlooTransport(group)
        self.stats = stats if stats is not None else LinkStats()
        self.staged = self.device.type != "cpu" if staged is None else staged
        self.pin = _can_pin(self.device)
        self._stager: ThreadPoolExecutor | None = None

    def post(self, sends: Sequence[SendSpec], recvs: Sequence[RecvSpec]
             ) -> tuple[list[SendHandle], list[RecvHandle]]:
        """Post every receive, then every send; nothing here waits for the peer."""
        recv_handles = [self._irecv(shape, dtype, peer) for shape, dtype, peer in recvs]
        send_handles = [self._isend(tensor, peer) for tensor, peer in sends]
        return send_handles, recv_handles

    def close(self) -> None:
        """Stop the stager thread and the transport (after the pending sends were waited for)."""
        if self._stager is not None:
            self._stager.shutdown(wait=True)
            self._stager = None
        self.transport.close()

    def _wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.config.dtype or dtype

    def _chunks(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return list(flat.split(self.config.chunk_elements(flat.element_size())))

    def _isend(self, tensor: torch.Tensor, peer: int) -> SendHandle:
        # [*shape] on the device; a copy only where a cast or a gather of rows is needed
        wire = tensor.detach().to(self._wire_dtype(tensor.dtype)).contiguous()
        self.stats.transfers += 1
        self.stats.bytes += _nbytes(wire)
        if not self.staged:
            chunks = self._chunks(wire.view(-1))
            self.stats.chunks += len(chunks)
            works = [self.transport.isend(c, peer) for c in chunks]
            return SendHandle(self.stats, works, keep=(wire,))
        host = _host_empty(wire.shape, wire.dtype, self.pin)
        pairs = list(zip(self._chunks(host.view(-1)), self._chunks(wire.view(-1))))
        events = []
        for host_chunk, dev_chunk in pairs:  # queued on the compute stream, returns at once
            host_chunk.copy_(dev_chunk, non_blocking=self.pin)
            events.append(self._record_event())
        self.stats.chunks += len(pairs)
        if self._stager is None:
            self._stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bridge-stager")
        future = self._stager.submit(self._send_staged, [h for h, _ in pairs], events, peer)
        return SendHandle(self.stats, future, keep=(host, wire))

    def _record_event(self) -> torch.Event | None:
        if not self.pin:
            return None  # the copy was synchronous
        event = torch.Event(device=self.device)
        event.record()
        return event

    def _send_staged(self, chunks: list[torch.Tensor], events: list[torch.Event | None],
                     peer: int) -> list[Work]:
        """Stager thread: post each chunk as soon as its device-to-host copy has finished."""
        works = []
        for chunk, event in zip(chunks, events):
            if event is not None:
                event.synchronize()
            works.append(self.transport.isend(chunk, peer))
        return works

    def _irecv(self, shape: tuple[int, ...], dtype: torch.dtype, peer: int) -> RecvHandle:
        wire_dtype = self._wire_dtype(dtype)
        host = _host_empty(shape, wire_dtype, self.pin)  # [*shape]
        host_chunks = self._chunks(host.view(-1))
        works = [self.transport.irecv(c, peer) for c in host_chunks]
        self.stats.bytes_recv += _nbytes(host)
        if not self.staged:
            steps: list[tuple[Work, Callable[[], object] | None]] = [(w, None) for w in works]
            return RecvHandle(self.stats, steps, lambda: host.to(dtype))
        dev = torch.empty(shape, dtype=wire_dtype, device=self.device)
        dev_chunks = self._chunks(dev.view(-1))
        steps = [(w, _copier(d, h, self.pin)) for w, d, h in zip(works, dev_chunks, host_chunks)]
        return RecvHandle(self.stats, steps, lambda: dev.to(dtype))


def _copier(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> Callable[[], object]:
    return lambda: dst.copy_(src, non_blocking=non_blocking)


class DirectLink:
    """Same-vendor neighbours: ``torch.distributed`` P2P on ``group`` (default: the default
    group), device tensors, one message per transfer; batched so NCCL cannot deadlock."""

    kind = "direct"

    def __init__(self, device: torch.device, stats: LinkStats | None = None,
                 group: dist.ProcessGroup | None = None) -> None:
        self.device, self.group = torch.device(device), group
        self.stats = stats if stats is not None else LinkStats()

    def post(self, sends: Sequence[SendSpec], recvs: Sequence[RecvSpec]
             ) -> tuple[list[SendHandle], list[RecvHandle]]:
        """Post every receive and every send as one batch; nothing here waits for the peer."""
        bufs = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype, _ in recvs]
        out = [t.detach().contiguous() for t, _ in sends]
        ops = [dist.P2POp(dist.irecv, b, peer, self.group) for b, (_, _, peer) in zip(bufs, recvs)]
        ops += [dist.P2POp(dist.isend, t, peer, self.group) for t, (_, peer) in zip(out, sends)]
        works = dist.batch_isend_irecv(ops) if ops else []
        self.stats.transfers += len(out)
        self.stats.chunks += len(out)
        self.stats.bytes += sum(_nbytes(t) for t in out)
        self.stats.bytes_recv += sum(_nbytes(b) for b in bufs)
        if len(works) == len(ops):  # one request per op (gloo)
            recv_works = [[w] for w in works[:len(bufs)]]
            send_works = [[w] for w in works[len(bufs):]]
        else:  # coalesced (NCCL): every handle waits on the whole batch
            recv_works = [list(works)] * len(bufs)
            send_works = [list(works)] * len(out)
        recv_handles = [RecvHandle(self.stats, [(w, None) for w in ws], _returner(b))
                        for ws, b in zip(recv_works, bufs)]
        send_handles = [SendHandle(self.stats, ws, keep=(t,)) for ws, t in zip(send_works, out)]
        return send_handles, recv_handles

    def close(self) -> None:
        """Nothing to release (present for symmetry with :class:`Bridge`)."""


def _returner(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: t
