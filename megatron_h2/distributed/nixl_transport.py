"""The ``nixl`` transport: NVIDIA NIXL one-sided writes into per-peer receive rings.

NIXL (``pip install nixl``; its UCX backend moves data over TCP, shared memory or RDMA,
whichever UCX finds: set ``UCX_TLS=tcp`` to force TCP) offers one-sided WRITEs with a
notification delivered after the data. The bridge's two-sided isend / irecv are built on it
like this, per ordered pair of ranks (sender -> receiver):

* set-up, collective with the peers over the gloo group: each rank creates one agent (UCX
  backend, no progress thread), allocates per peer a receive ring and a send ring of
  ``slots x slot_bytes`` host bytes, registers them, and sends the peer its agent metadata and
  the address of the receive ring meant for that peer;
* a posted transfer is cut into pieces of at most ``slot_bytes``; piece ``k`` (counted per
  pair and direction) is copied into send slot ``k % slots`` and written into the receiver's
  slot ``k % slots``, with notification ``D<k>``;
* the receiver copies arrived pieces out of their slots into the posted buffers, in order, and
  returns a credit, notification ``C<n>`` (pieces consumed so far); the sender writes piece
  ``k`` only while ``k < n + slots``, so no slot is overwritten before it was read.

One engine thread per transport owns the agent: it posts writes, polls their states and the
notifications (which also drives UCX), copies pieces in and out and completes the works. While
transfers are pending it polls with a back-off of up to 1 ms; otherwise it progresses UCX every
few milliseconds, so writes from a peer land in the ring before the matching receive is posted.

Device-direct transfers (NIXL's VRAM segments, GPUDirect RDMA) would register device memory
instead of host rings; this transport always stages through host memory, as the bridge does.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

IDLE_POLL_S = 0.002  # UCX progress while nothing is pending
MAX_BACKOFF_S = 1e-3  # longest sleep between polls while transfers are pending


class NixlWork:
    """A posted transfer of one or more pieces; the engine thread completes it."""

    def __init__(self, pieces: int, what: str, timeout_s: float) -> None:
        self._left, self._what, self._timeout = pieces, what, timeout_s
        self._event = threading.Event()
        self._error: BaseException | None = None
        if pieces == 0:
            self._event.set()

    def piece_done(self) -> None:
        self._left -= 1
        if self._left == 0:
            self._event.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    def is_completed(self) -> bool:
        return self._event.is_set()

    def wait(self) -> bool:
        if not self._event.wait(self._timeout):
            raise RuntimeError(f"nixl transport: {self._what} did not complete within "
                               f"{self._timeout:g} s (peer gone or stalled)")
        if self._error is not None:
            raise RuntimeError(f"nixl transport: {self._what} failed: {self._error}")
        return True


@dataclass
class _Piece:
    seq: int
    data: torch.Tensor  # uint8 view of the caller's buffer (source or destination)
    work: NixlWork


@dataclass
class _Peer:
    """Ring buffers and counters of one peer (both directions)."""

    rank: int
    send_ring: torch.Tensor  # [slots, slot_bytes] uint8, registered
    recv_ring: torch.Tensor  # [slots, slot_bytes] uint8, registered; the peer writes here
    name: bytes | str = ""  # the peer's agent name, as NIXL returned it
    remote_ring: int = 0  # address of the peer's receive ring for data from us
    next_send: int = 0  # sequence number of the next piece submitted for sending
    next_recv: int = 0  # sequence number of the next piece posted for receiving
    pending: deque = field(default_factory=deque)  # pieces to write, in order
    inflight: dict = field(default_factory=dict)  # seq -> (xfer handle, piece)
    acked: int = 0  # pieces the peer has consumed (from its credits)
    posted: deque = field(default_factory=deque)  # pieces to receive, in order
    arrived: set = field(default_factory=set)  # sequence numbers whose data has landed
    consumed: int = 0


def _text(name: bytes | str) -> str:
    return name.decode() if isinstance(name, bytes) else name


def _bytes_of(buf: torch.Tensor) -> torch.Tensor:
    if not buf.is_contiguous() or buf.device.type != "cpu":
        raise ValueError("nixl transport moves contiguous host buffers only")
    return buf.reshape(-1).view(torch.uint8)


def _exchange(group: dist.ProcessGroup | None, out: dict[int, bytes]) -> dict[int, bytes]:
    """Send ``out[peer]`` to every peer and receive one byte string from each (gloo)."""
    peers = sorted(out)
    sizes = {p: torch.zeros(1, dtype=torch.int64) for p in peers}
    works = [dist.irecv(sizes[p], p, group=group) for p in peers]
    works += [dist.isend(torch.tensor([len(out[p])], dtype=torch.int64), p, group=group)
              for p in peers]
    for work in works:
        work.wait()
    bufs = {p: torch.empty(int(sizes[p]), dtype=torch.uint8) for p in peers}
    payload = {p: torch.frombuffer(bytearray(out[p]), dtype=torch.uint8) for p in peers}
    works = [dist.irecv(bufs[p], p, group=group) for p in peers]
    works += [dist.isend(payload[p], p, group=group) for p in peers]
    for work in works:
        work.wait()
    return {p: bufs[p].numpy().tobytes() for p in peers}


class NixlTransport:
    """:class:`~megatron_h2.distributed.transport.Transport` over NIXL (see the module
    docstring). Construction is collective with ``peers`` over the gloo ``group``."""

    name = "nixl"

    def __init__(self, group: dist.ProcessGroup | None, rank: int, peers: Sequence[int],
                 slot_bytes: int, tag: str = "bridge", slots: int = 4,
                 timeout_s: float = 600.0) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        if not os.environ.get("NIXL_LOG_LEVEL"):
            logging.getLogger("nixl").setLevel(logging.WARNING)
        self.slot_bytes, self.slots, self.timeout_s = max(64, int(slot_bytes)), slots, timeout_s
        self.agent = nixl_agent(f"{tag}-rank{rank}",
                                nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        if "UCX" not in self.agent.backends:
            raise RuntimeError("nixl transport: NIXL has no UCX backend on this machine")
        self._peers = {p: _Peer(p, *(torch.zeros(self.slots, self.slot_bytes, dtype=torch.uint8)
                                     for _ in range(2))) for p in peers}
        rings = [t for peer in self._peers.values() for t in (peer.send_ring, peer.recv_ring)]
        self._registered = self.agent.register_memory(rings) if rings else None
        meta = self.agent.get_agent_metadata()
        got = _exchange(group, {p: struct.pack("<Q", peer.recv_ring.data_ptr()) + meta
                                for p, peer in self._peers.items()})
        self._by_name: dict[str, _Peer] = {}
        for p, data in got.items():
            peer = self._peers[p]
            peer.remote_ring = struct.unpack("<Q", data[:8])[0]
            peer.name = self.agent.add_remote_agent(data[8:])  # bytes; notifications key str
            self._by_name[_text(peer.name)] = peer
        for peer in self._peers.values():
            self.agent.make_connection(peer.name)
        self._cond = threading.Condition()
        self._stop, self._error = False, None
        self._thread = threading.Thread(target=self._run, name=f"nixl-{tag}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------- posting
    def _post(self, buf: torch.Tensor, peer: int, sending: bool) -> NixlWork:
        if peer not in self._peers:
            raise ValueError(f"nixl transport: rank {peer} is not a peer of this transport")
        data = _bytes_of(buf)
        pieces = list(data.split(self.slot_bytes)) if data.numel() else []
        what = f"{'send to' if sending else 'receive from'} rank {peer}"
        work = NixlWork(len(pieces), what, self.timeout_s)
        p = self._peers[peer]
        with self._cond:
            if self._error is not None:
                raise RuntimeError(f"nixl transport failed earlier: {self._error}")
            for piece in pieces:
                if sending:
                    p.pending.append(_Piece(p.next_send, piece, work))
                    p.next_send += 1
                else:
                    p.posted.append(_Piece(p.next_recv, piece, work))
                    p.next_recv += 1
            self._cond.notify()
        return work

    def isend(self, buf: torch.Tensor, peer: int) -> NixlWork:
        return self._post(buf, peer, sending=True)

    def irecv(self, buf: torch.Tensor, peer: int) -> NixlWork:
        return self._post(buf, peer, sending=False)

    def close(self) -> None:
        """Stop the engine thread (after the caller waited for its transfers)."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=10)

    # -------------------------------------------------------------------------- engine
    def _busy(self) -> bool:
        return any(p.pending or p.inflight or p.posted for p in self._peers.values())

    def _run(self) -> None:
        delay = 0.0
        try:
            while True:
                with self._cond:
                    if not self._busy():
                        if self._stop:
                            return
                        self._cond.wait(IDLE_POLL_S)
                progressed = self._step()
                delay = 0.0 if progressed else min(max(2 * delay, 2e-5), MAX_BACKOFF_S)
                if delay:
                    time.sleep(delay)
        except BaseException as exc:  # noqa: BLE001 - fail every waiting transfer, loudly
            with self._cond:
                self._error = exc
                for peer in self._peers.values():
                    for piece in [*peer.pending, *peer.posted,
                                  *(p for _, p in peer.inflight.values())]:
                        piece.work.fail(exc)

    def _step(self) -> bool:
        progressed = False
        for name, messages in self.agent.get_new_notifs().items():
            peer = self._by_name[_text(name)]
            for message in messages:
                kind, count = message[:1], int(message[1:])
                if kind == b"D":
                    peer.arrived.add(count)
                elif kind == b"C":
                    peer.acked = max(peer.acked, count)
                progressed = True
        for peer in self._peers.values():
            progressed |= self._receive(peer)
            progressed |= self._complete_writes(peer)
            progressed |= self._start_writes(peer)
        return progressed

    def _receive(self, peer: _Peer) -> bool:
        """Copy arrived pieces out of the ring into posted buffers, in order; credit them."""
        before = peer.consumed
        while True:
            with self._cond:
                piece = peer.posted[0] if peer.posted else None
            if piece is None or piece.seq not in peer.arrived:
                break
            piece.data.copy_(peer.recv_ring[piece.seq % self.slots, :piece.data.numel()])
            peer.arrived.discard(piece.seq)
            with self._cond:
                peer.posted.popleft()
            peer.consumed += 1
            piece.work.piece_done()
        if peer.consumed == before:
            return False
        self.agent.send_notif(peer.name, b"C%d" % peer.consumed)
        return True

    def _complete_writes(self, peer: _Peer) -> bool:
        done = []
        for seq, (handle, piece) in peer.inflight.items():
            state = self.agent.check_xfer_state(handle)
            if state == "ERR":
                raise RuntimeError(f"write of piece {seq} to rank {peer.rank} failed")
            if state == "DONE":
                done.append(seq)
                self.agent.release_xfer_handle(handle)
                piece.work.piece_done()
        for seq in done:
            del peer.inflight[seq]
        return bool(done)

    def _start_writes(self, peer: _Peer) -> bool:
        started = False
        while True:
            with self._cond:
                piece = peer.pending[0] if peer.pending else None
            if piece is None or piece.seq >= peer.acked + self.slots:
                break  # nothing to send, or the peer's ring is full
            slot = piece.seq % self.slots
            if piece.seq - self.slots in peer.inflight:
                break  # our send slot is still being read by the previous write
            n = piece.data.numel()
            peer.send_ring[slot, :n].copy_(piece.data)
            local = self.agent.get_xfer_descs(
                [(peer.send_ring[slot].data_ptr(), n, 0)], "DRAM")
            remote = self.agent.get_xfer_descs(
                [(peer.remote_ring + slot * self.slot_bytes, n, 0)], "DRAM")
            handle = self.agent.initialize_xfer("WRITE", local, remote, peer.name,
                                                b"D%d" % piece.seq)
            if self.agent.transfer(handle) == "ERR":
                raise RuntimeError(f"posting piece {piece.seq} to rank {peer.rank} failed")
            peer.inflight[piece.seq] = (handle, piece)
            with self._cond:
                peer.pending.popleft()
            started = True
        return started
