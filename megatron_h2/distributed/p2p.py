"""Point-to-point traffic between neighbouring pipeline stages.

The two sides of a stage boundary may have different TP degrees and run on chips of different
vendors. Per boundary, :class:`PipeComm` picks the path (:class:`~.bridge.DirectLink` when
both stages use the same device type, the host-staged :class:`~.bridge.Bridge` when they differ
or ``BridgeConfig.force`` is set; the bridge's transport is the one the plan names for the two
chip types, gloo by default) and the transfer plan (:mod:`~.boundary`), which re-shards the
activation ``[mbs, seq, h]`` (``[mbs, seq / TP, h]`` per rank with sequence parallelism) between
the two TP groups. Shapes are fixed for a run, so no shape is ever exchanged. Where the two
stages have different DP degrees, the message of micro-batch ``j`` goes to (or comes from) the TP
group of replica ``j mod DP`` of the other stage (:func:`~.boundary.rank_routes`); every
call that moves a micro-batch's data names it (:meth:`PipeComm.exchange`).

Sends stay in flight after a call returns: the next micro-batch is computed while the last one
is on the wire. :meth:`PipeComm.wait_sends` completes them (call it at the end of every step);
until then each send keeps its buffers alive. Every call posts its receives before its sends and
waits only on its own receives, so neighbours never wait on each other in a cycle: the 1F1B
schedule's data dependencies are the only waits.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from megatron_h2.distributed.boundary import (
    BoundaryPlan,
    Routes,
    Transfer,
    local_rows,
    rank_routes,
)
from megatron_h2.distributed.bridge import (
    Bridge,
    BridgeConfig,
    DirectLink,
    LinkStats,
    RecvHandle,
    SendHandle,
)
from megatron_h2.distributed.topology import Topology
from megatron_h2.distributed.transport import make_transport
from megatron_h2.errors import ConfigError


class CommObserver(Protocol):
    """Receives the intervals this rank spent in pipeline communication, for a timeline.

    Times are :func:`time.time` seconds. ``kind`` is ``send_forward`` / ``send_backward`` (posting
    the send, including any staging; the wire time after it overlaps compute and is not
    reported), ``recv_forward`` / ``recv_backward`` (from posting until the data is there), or
    ``wait`` (micro-batch -1: :meth:`PipeComm.wait_sends` blocked on sends still in flight).
    """

    def on_comm(self, kind: str, micro_batch: int, start_s: float, end_s: float,
                chunk: int = 0) -> None: ...


@dataclass
class _Side:
    """One boundary of this rank: its plans (per replica of the other stage, whose DP degree
    is ``dp``) and its transport."""

    routes: Routes
    dp: int
    link: Bridge | DirectLink

    def plan_of(self, micro_batch: int) -> BoundaryPlan:
        """The plan of micro-batch ``micro_batch`` (with replica ``micro_batch mod dp``). With
        one partner replica (the neighbour has this stage's DP degree) that replica's plan, so
        callers may number micro-batches per replica (0 .. m-1 on every replica) as well."""
        if len(self.routes) == 1:
            return next(iter(self.routes.values()))
        return self.routes[micro_batch % self.dp]

    @property
    def plan(self) -> BoundaryPlan:
        """The only plan, where the other stage has this stage's DP degree."""
        if len(self.routes) != 1:
            raise ValueError("this boundary routes micro-batches to several replicas: use "
                             "PipeComm.exchange, which names the micro-batch")
        return next(iter(self.routes.values()))


def _peers(routes: Routes) -> list[int]:
    """Every rank that a boundary's plans exchange with."""
    return sorted({tr.peer for plan in routes.values()
                   for tr in (*plan.fwd_send, *plan.fwd_recv, *plan.bwd_send, *plan.bwd_recv)})


def _device_type(name: str) -> str:
    return str(name).split(":")[0]


def _check_cpu_group(cpu_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The bridge's gloo group: the one passed in, or the default group if that is gloo."""
    if cpu_group is not None:
        return cpu_group
    if "gloo" not in str(dist.get_backend()):
        raise ConfigError("a pipeline boundary crosses chip types but no CPU (gloo) process "
                          "group was passed to PipeComm; create one with "
                          "dist.new_group(backend='gloo') on every rank and pass it as cpu_group")
    return None  # the default group is gloo


class PipeComm:
    """Activation / gradient exchange of one rank with its pipeline neighbours.

    ``devices`` maps stage index -> device type (default: the plan's chip of each stage);
    ``sequence_parallel`` says whether activations are split along the sequence over TP;
    ``cpu_group`` is the gloo group the bridge uses (None: ``topo.cpu_group`` if set, else
    the default group, which must then be gloo; unused when no boundary uses the bridge).
    ``sequence_parallel`` must be the job-wide flag, the same on every rank (a TP-1 stage holds
    the whole sequence either way), not a per-stage value. A no-op on a single stage.
    """

    def __init__(self, topo: Topology, micro_batch: int, seq_length: int, hidden: int,
                 sequence_parallel: bool, dtype: torch.dtype, device: torch.device,
                 bridge: BridgeConfig, cpu_group: dist.ProcessGroup | None,
                 devices: dict[int, str] | None = None,
                 observer: CommObserver | None = None) -> None:
        self.dtype, self.device = dtype, torch.device(device)
        self.micro_batch, self.hidden = micro_batch, hidden
        self.bridge_config, self.observer = bridge, observer
        rows = local_rows(seq_length, topo.tp_size, topo.tp_rank, sequence_parallel)
        self.shape = (micro_batch, rows.stop - rows.start, hidden)  # [b, s or s/tp, h]
        if devices is None:
            devices = {s: topo.plan.chips[spec.chip].device
                       for s, spec in enumerate(topo.plan.stages)}
        missing = sorted(set(range(topo.pp_size)) - set(devices))
        if missing:
            raise ConfigError(f"PipeComm devices name no device type for stages {missing}")
        self.devices = {s: _device_type(d) for s, d in devices.items()}
        self.bridge_stats, self.direct_stats = LinkStats(), LinkStats()
        self.transports: dict[int, str] = {}  # bridged boundary (upstream stage) -> transport
        self.stage, self.stages = topo.stage, topo.pp_size
        self.chunks = topo.plan.virtual_pipeline_size
        prev_routes, next_routes = rank_routes(topo.plan, topo.rank, seq_length,
                                               sequence_parallel)
        prev_up, next_up = (topo.stage - 1) % topo.pp_size, topo.stage
        bridge_group: dist.ProcessGroup | None = None
        if any(self._bridged(up) for up, r in ((prev_up, prev_routes), (next_up, next_routes))
               if r is not None and not self._wraps(up)):
            if cpu_group is None:
                cpu_group = getattr(topo, "cpu_group", None)
            bridge_group = _check_cpu_group(cpu_group)
        # links are made in boundary order (the wrap-around boundary last): transports that
        # exchange set-up data with their peers then meet in the same order on every rank
        sides: dict[str, _Side] = {}
        for name, up, routes in sorted((("prev", prev_up, prev_routes),
                                        ("next", next_up, next_routes)), key=lambda side: side[1]):
            if routes is not None:
                other = up if name == "prev" else (up + 1) % topo.pp_size
                sides[name] = _Side(routes, topo.plan.stage_dp(other),
                                    self._link(topo, up, bridge_group, _peers(routes)))
        self.prev, self.next = sides.get("prev"), sides.get("next")
        self._pending: list[SendHandle] = []  # sends in flight, oldest first
        self._counts = dict.fromkeys(
            ("send_forward", "recv_forward", "send_backward", "recv_backward"), 0)

    # ------------------------------------------------------------------------------- set-up
    def _bridged(self, upstream: int) -> bool:
        """Whether the boundary from stage ``upstream`` to the next one uses the bridge."""
        return (self.bridge_config.force
                or self.devices[upstream] != self.devices[(upstream + 1) % self.stages])

    def _wraps(self, upstream: int) -> bool:
        """The wrap-around boundary (last stage -> first stage, with virtual stages)."""
        return upstream == self.stages - 1

    def _link(self, topo: Topology, upstream: int, group: dist.ProcessGroup | None,
              peers: list[int]) -> Bridge | DirectLink:
        wrap = self._wraps(upstream)
        if wrap and (topo.wrap_group is None or topo.wrap_cpu_group is None):
            raise ConfigError("virtual pipeline stages need the wrap-around boundary's process "
                              "groups; build the topology with build_topology")
        if not self._bridged(upstream):
            return DirectLink(self.device, self.direct_stats, topo.wrap_group if wrap else None)
        group = topo.wrap_cpu_group if wrap else group
        stages = topo.plan.stages
        name = topo.plan.transport_between(stages[upstream].chip,
                                           stages[(upstream + 1) % self.stages].chip)
        self.transports[upstream] = name
        cfg = self.bridge_config
        transport = make_transport(name, group, topo.rank, peers,
                                   cfg.chunk_elements(1), f"b{upstream}", cfg.timeout_s)
        return Bridge(group, self.device, cfg, self.bridge_stats, transport=transport)

    @property
    def paths(self) -> dict[str, str | None]:
        """Transport of each boundary: ``{"prev": "bridge" | "direct" | None, "next": ...}``."""
        return {"prev": None if self.prev is None else self.prev.link.kind,
                "next": None if self.next is None else self.next.link.kind}

    # ---------------------------------------------------------------------------- the core
    def _next_index(self, kind: str) -> int:
        index = self._counts[kind]
        self._counts[kind] += 1
        return index

    def _pieces(self, tensor: torch.Tensor, plan: tuple[Transfer, ...]
                ) -> list[tuple[torch.Tensor, int]]:
        """The rows of ``tensor`` [b, s_local, h] each transfer carries, with its peer."""
        if tuple(tensor.shape) != self.shape:
            raise ValueError(f"pipeline send of shape {tuple(tensor.shape)}, but this rank's "
                             f"activation is {self.shape} (micro-batch, sequence rows, hidden)")
        tensor = tensor.detach().to(self.dtype)
        full = self.shape[1]
        return [(tensor if (tr.local.start, tr.local.stop) == (0, full) else tensor[:, tr.local],
                 tr.peer) for tr in plan]

    def _exchange(self, side: _Side, send: torch.Tensor | None, send_plan: tuple[Transfer, ...],
                  send_kind: str, recv_plan: tuple[Transfer, ...] | None,
                  recv_kind: str) -> torch.Tensor | None:
        """Post ``recv_plan`` (if any) then the send of ``send`` (if any); wait for the receive
        only. Returns the received tensor [b, s_local, h] or None."""
        self._reap()
        start = time.time()
        recvs = [((self.shape[0], tr.num_rows, self.shape[2]), self.dtype, tr.peer)
                 for tr in recv_plan or ()]
        sends = [] if send is None else self._pieces(send, send_plan)
        send_handles, recv_handles = side.link.post(sends, recvs)
        posted = time.time()
        if send is not None:
            self._pending.extend(send_handles)
            self._observe(send_kind, self._next_index(send_kind), start, posted)
        if recv_plan is None:
            return None
        index = self._next_index(recv_kind)
        out = self._assemble(recv_plan, recv_handles)
        self._observe(recv_kind, index, posted, time.time())
        return out

    def _observe(self, kind: str, micro_batch: int, start_s: float, end_s: float,
                 chunk: int = 0) -> None:
        if self.observer is not None:
            self.observer.on_comm(kind, micro_batch, start_s, end_s, chunk)

    def _assemble(self, plan: tuple[Transfer, ...], handles: list[RecvHandle]) -> torch.Tensor:
        if len(handles) == 1 and plan[0].num_rows == self.shape[1]:
            return handles[0].wait()
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        for tr, handle in zip(plan, handles):
            out[:, tr.local] = handle.wait()
        return out

    def _reap(self) -> None:
        """Release the buffers of sends that have completed (never blocks)."""
        still = []
        for handle in self._pending:
            if handle.is_completed():
                handle.wait()
            else:
                still.append(handle)
        self._pending = still

    # -------------------------------------------------------------------- schedule calls
    def recv_forward(self) -> torch.Tensor | None:
        """Input activation from the previous stage [b, s_local, h] (None on the first stage)."""
        if self.prev is None:
            return None
        out = self._exchange(self.prev, None, (), "", self.prev.plan.fwd_recv, "recv_forward")
        return out.requires_grad_()

    def send_forward(self, output: torch.Tensor) -> None:
        """Send this stage's output activation [b, s_local, h] on (returns at once)."""
        if self.next is not None:
            self._exchange(self.next, output, self.next.plan.fwd_send, "send_forward", None, "")

    def recv_backward(self) -> torch.Tensor | None:
        """Gradient of this stage's output from the next stage (None on the last stage)."""
        if self.next is None:
            return None
        return self._exchange(self.next, None, (), "", self.next.plan.bwd_recv, "recv_backward")

    def send_backward(self, grad: torch.Tensor | None) -> None:
        """Send the gradient of this stage's input back (returns at once); None sends zeros."""
        if self.prev is not None:
            self._exchange(self.prev, self._grad(grad), self.prev.plan.bwd_send, "send_backward",
                           None, "")

    def send_forward_recv_backward(self, output: torch.Tensor) -> torch.Tensor | None:
        """Send ``output`` on and receive the gradient of an earlier output (steady state)."""
        if self.next is None:
            return None
        return self._exchange(self.next, output, self.next.plan.fwd_send, "send_forward",
                              self.next.plan.bwd_recv, "recv_backward")

    def send_backward_recv_forward(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """Send ``grad`` back and receive the next input activation (steady state)."""
        if self.prev is None:
            return None
        out = self._exchange(self.prev, self._grad(grad), self.prev.plan.bwd_send,
                             "send_backward", self.prev.plan.fwd_recv, "recv_forward")
        return out.requires_grad_()

    # ----------------------------------------------------------- chunk-aware exchange
    def _side_of(self, way: str, chunk: int, sending: bool) -> _Side:
        """The boundary a message of virtual stage (this stage, ``chunk``) crosses: forward
        sends and backward receives go downstream, the others upstream."""
        downstream = (way == "forward") == sending
        exists = (not (self.stage == self.stages - 1 and chunk == self.chunks - 1)
                  if downstream else not (self.stage == 0 and chunk == 0))
        side = self.next if downstream else self.prev
        if not exists or side is None or not 0 <= chunk < self.chunks:
            where = "after" if downstream else "before"
            raise ValueError(f"no virtual stage {where} chunk {chunk} of stage {self.stage}")
        return side

    def exchange(self, sends: Sequence[tuple[str, int, int, torch.Tensor | None]],
                 recv: tuple[str, int, int] | None) -> torch.Tensor | None:
        """Post ``recv`` (``(way, chunk, micro_batch)``: ``way`` ``forward`` for the input
        activation of this stage's ``chunk``, ``backward`` for the gradient of its output),
        then every send ``(way, chunk, micro_batch, tensor)`` (``forward``: the chunk's output,
        ``backward``: the gradient of its input, None for zeros); wait for the receive only and
        return it ([b, s_local, h]; an activation requires grad). Messages of one boundary and
        direction must be received in the order they are sent."""
        self._reap()
        start = time.time()
        recv_side = None if recv is None else self._side_of(recv[0], recv[1], False)
        posts: dict[int, tuple[_Side, list, list]] = {}
        if recv_side is not None:
            route = recv_side.plan_of(recv[2])
            plan = route.fwd_recv if recv[0] == "forward" else route.bwd_recv
            posts[id(recv_side)] = (recv_side, [], [
                ((self.shape[0], tr.num_rows, self.shape[2]), self.dtype, tr.peer)
                for tr in plan])
        sent = []
        for way, chunk, micro_batch, tensor in sends:
            side = self._side_of(way, chunk, True)
            if way == "backward":
                tensor = self._grad(tensor)
            route = side.plan_of(micro_batch)
            plan = route.fwd_send if way == "forward" else route.bwd_send
            posts.setdefault(id(side), (side, [], []))[1].extend(self._pieces(tensor, plan))
            sent.append((f"send_{way}", micro_batch, chunk))
        handles = None
        for side, send_pieces, recv_specs in posts.values():  # the receive's side first
            send_handles, recv_handles = side.link.post(send_pieces, recv_specs)
            self._pending.extend(send_handles)
            if recv_specs:
                handles = recv_handles
        posted = time.time()
        for kind, micro_batch, chunk in sent:
            self._observe(kind, micro_batch, start, posted, chunk)
        if recv is None:
            return None
        route = recv_side.plan_of(recv[2])
        out = self._assemble(route.fwd_recv if recv[0] == "forward" else route.bwd_recv, handles)
        self._observe(f"recv_{recv[0]}", recv[2], posted, time.time(), recv[1])
        return out.requires_grad_() if recv[0] == "forward" else out

    def _grad(self, grad: torch.Tensor | None) -> torch.Tensor:
        """An input that got no gradient still answers its sender, with zeros."""
        if grad is None:
            return torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        return grad

    # ------------------------------------------------------------------- step boundaries
    def wait_sends(self) -> None:
        """Complete every send still in flight and start counting micro-batches from 0 again.

        Call at the end of every step (train and eval); safe when nothing is pending.
        """
        pending, self._pending = self._pending, []
        blocked = not all(h.is_completed() for h in pending)
        start = time.time()
        for handle in pending:
            handle.wait()
        if blocked:
            self._observe("wait", -1, start, time.time())
        for kind in self._counts:
            self._counts[kind] = 0

    def stats(self) -> dict[str, float]:
        """Counters since the last :meth:`reset_stats`: per path (``bridge_*``, ``direct_*``)
        ``bytes`` (sent, after any wire cast), ``bytes_recv``, ``transfers`` (messages sent),
        ``chunks`` (wire sends), ``send_wait_s`` and ``recv_wait_s`` (blocked seconds); plus the
        totals ``send_wait_s`` and ``recv_wait_s``."""
        out: dict[str, float] = {}
        out.update(self.bridge_stats.as_dict("bridge"))
        out.update(self.direct_stats.as_dict("direct"))
        out["send_wait_s"] = self.bridge_stats.send_wait_s + self.direct_stats.send_wait_s
        out["recv_wait_s"] = self.bridge_stats.recv_wait_s + self.direct_stats.recv_wait_s
        return out

    def reset_stats(self) -> None:
        self.bridge_stats.reset()
        self.direct_stats.reset()

    def close(self) -> None:
        """Complete pending sends and stop the bridges' stager threads."""
        self.wait_sends()
        for side in (self.prev, self.next):
            if side is not None:
                side.link.close()
