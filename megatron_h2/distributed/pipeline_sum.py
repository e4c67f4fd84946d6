"""The gradient sum across data-parallel pipelines that may shard each parameter differently.

Each pipeline of a plan of several (:mod:`megatron_h2.plan.schema`) first sums its gradients
over its own replicas (:class:`~megatron_h2.distributed.grad_sync.GradBuckets`: every stage's
DP group, then the tied embedding and the sequence-parallel norms). After that, in pipeline
``k``, each rank holds the summed gradient ``g_k`` of the range of every bucket that its DP rank
owns (:meth:`Bucket.shard_range`: its ZeRO-1 shard, or under the replicated optimizer the part
of the all-reduced buffer it answers for). :class:`PipelineGradSum` then makes every such range
the total ``g_0 + g_1 + ... + g_{P-1}``:

* each rank describes what it holds (:class:`~.shard_boxes.Holding`: parameter, TP shard,
  range) once, at start-up, and learns everyone's;
* in every other pipeline, the *primary* holder of each element (one per element and pipeline:
  TP rank 0 of a TP-replicated parameter, never the last stage's tied copy) sends it to every
  rank that holds it, one message per pair of ranks and bucket, with the rectangles their
  shards share (:func:`~.shard_boxes.transfers`): each rank exchanges the overlap of its shard
  with the other layout's shards, whatever their TP degree, stage boundaries or bucket layout;
* a bucket's messages leave as soon as its DP reduction has finished, during the last backward
  (:meth:`PipelineGradSum.bucket_synced`); the tied embedding's bucket and the
  sequence-parallel norms follow once they are complete (:meth:`PipelineGradSum.finish`);
* every holder adds the pipelines' values in pipeline order, so every copy of an element is
  bitwise the same and the pipelines' weights stay equal; under the replicated optimizer each
  stage's DP group then all-gathers the buckets' ranges.

Under expert parallelism a stage's optimizer has two sets of buckets (the dense parameters'
over the DP group, the routed experts' over the expert-DP group,
:mod:`megatron_h2.optimizer.expert_optimizer`): each rank's holdings are those of both, each
set's ranges taken at its own group rank. The experts' parameters are named by global expert
index, so every replica of an expert in any pipeline, under any EP degree, exchanges with the
others by name as a TP shard does. The units (what leaves together) are the dense set's buckets
then the expert set's, sent in that order whatever order the two sets finish their DP
reductions in, since a pair of ranks must post its messages in the order the receiver expects.

Messages carry fp32 (the optimizer's gradients) and go through the host-staged
:class:`~.bridge.Bridge` (gloo) where the two ranks' device types differ or ``--force-bridge``
is set, else directly (:class:`~.bridge.DirectLink`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from megatron_h2.devices import ACCELERATORS
from megatron_h2.distributed.bridge import (
    Bridge,
    BridgeConfig,
    DirectLink,
    LinkStats,
    RecvHandle,
    SendHandle,
)
from megatron_h2.distributed.grad_sync import Bucket, GradBuckets, all_gather_flat
from megatron_h2.distributed.shard_boxes import Holding, ParamLayout, Transfer, transfers
from megatron_h2.distributed.topology import Topology

WIRE_DTYPE = torch.float32
"""What the messages carry: the optimizer's (fp32) gradients."""


@dataclass
class _Held:
    """One of this rank's holdings and where its elements live: ``bucket``'s elements
    ``[offset, offset + numel)`` (in the bucket's flat order; ``bucket`` indexes every set's
    buckets in order)."""

    holding: Holding
    bucket: int
    offset: int


@dataclass(frozen=True)
class _Message:
    """The rectangles one rank sends another for one unit (bucket) of the sender."""

    peer: int
    pipeline: int  # the sender's pipeline (on the receiving side)
    unit: int
    parts: tuple[Transfer, ...]

    @property
    def numel(self) -> int:
        return sum(part.numel for part in self.parts)


def _by_unit(parts: list[Transfer], senders: list[Holding]
             ) -> list[tuple[int, tuple[Transfer, ...]]]:
    """``parts`` grouped by the unit of their sending holding, units in ascending order (the
    order in which the sender posts them)."""
    units: dict[int, list[Transfer]] = {}
    for part in parts:
        units.setdefault(senders[part.send_index].unit, []).append(part)
    return [(unit, tuple(units[unit])) for unit in sorted(units)]


def _rect(data: torch.Tensor, holding: Holding, row: int, col: int, rows: int, cols: int
          ) -> torch.Tensor:
    """``rows x cols`` of the holding's shard from ``(row, col)`` on, as a view of ``data`` (its
    elements ``[start, stop)``, flat)."""
    stride = holding.local_shape[1]
    offset = row * stride + col - holding.start
    return data.as_strided((rows, cols), (stride, 1), data.storage_offset() + offset)


class PipelineGradSum:
    """Sums this rank's gradient ranges with every other pipeline's (see the module doc).

    ``buckets`` are the optimizer's :class:`GradBuckets`, or under expert parallelism an object
    whose ``parts`` are its sets of them (dense first); ``layouts`` describes each of their
    parameters (:class:`ParamLayout`); ``late`` are the parameters whose gradients are complete
    only after the step's last changes (the sequence-parallel norms, summed over TP after the DP
    sync); ``grads`` gives the optimizer's gradient tensors, one per bucket of every set in
    order (the buffers, or this rank's reduced shards, or their fp32 copies: what the optimizer
    reads). Collective at construction (every rank of the job); :meth:`attach` then sends each
    bucket as soon as its DP reduction has finished.
    """

    def __init__(self, topo: Topology, buckets: GradBuckets,
                 layouts: dict[nn.Parameter, ParamLayout], late: Sequence[nn.Parameter],
                 grads: Callable[[], list[torch.Tensor]], bridge: BridgeConfig,
                 device: torch.device) -> None:
        self.topo, self.grads = topo, grads
        self.device = torch.device(device)
        self.parts: list[GradBuckets] = list(getattr(buckets, "parts", (buckets,)))
        # every set's buckets in order, as (set, bucket); units: the early buckets in this
        # order, then one unit for the deferred buckets and the late parameters
        self.slots = [(part, b) for part in self.parts for b in part.buckets]
        early = [g for g, (part, b) in enumerate(self.slots) if b.index < part.first_deferred]
        self.unit_of = {g: unit for unit, g in enumerate(early)}
        self.late_unit = len(early)
        self.first = [sum(len(p.buckets) for p in self.parts[:i]) for i in range(len(self.parts))]
        self.held = self._holdings(layouts, {id(p) for p in late})
        everyone: list[list[Holding]] = [[] for _ in range(topo.world_size)]
        dist.all_gather_object(everyone, [h.holding for h in self.held], group=topo.cpu_group)
        self.stats = LinkStats()
        self.sends, self.recvs = self._messages(everyone)
        config = BridgeConfig(force=bridge.force, chunk_mb=bridge.chunk_mb,
                              timeout_s=bridge.timeout_s)  # gradients travel exact: no wire cast
        self.links = self._links(config)
        self._pending_recvs: list[tuple[_Message, RecvHandle]] = []
        self._pending_sends: list[SendHandle] = []
        self._sent_units: set[int] = set()
        self._synced_units: set[int] = set()

    def attach(self) -> None:
        """Be told by every set of buckets when one has finished its DP reduction."""
        for index, part in enumerate(self.parts):
            part.on_synced = partial(self.bucket_synced, part=index)

    # ---------------------------------------------------------------------------- set-up
    def _holdings(self, layouts: dict[nn.Parameter, ParamLayout], late: set[int]) -> list[_Held]:
        """This rank's ranges of every bucket (its DP shard range in that set's group),
        parameter by parameter."""
        topo, out = self.topo, []
        for g, (part, bucket) in enumerate(self.slots):
            lo, hi = bucket.shard_range(part.dp_rank)
            for slot in bucket.slots:
                start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if start >= end:
                    continue
                unit = self.unit_of.get(g, self.late_unit)
                if id(slot.param) in late:
                    unit = self.late_unit
                holding = Holding(layouts[slot.param], topo.tp_rank, topo.tp_size,
                                  start - slot.offset, end - slot.offset, unit)
                out.append(_Held(holding, g, start))
        return out

    def _messages(self, everyone: list[list[Holding]]
                  ) -> tuple[dict[int, list[_Message]], list[_Message]]:
        """This rank's sends (by unit) and receives, each with every rank of another pipeline
        whose holdings overlap; every element it holds must arrive once from each of them."""
        plan, me = self.topo.job_plan, self.topo.rank
        assert plan is not None
        mine = everyone[me]
        sends: dict[int, list[_Message]] = {}
        recvs: list[_Message] = []
        covered = [[0] * plan.num_pipelines for _ in mine]
        for peer, theirs in enumerate(everyone):
            pipeline = plan.pipeline_of_rank(peer)
            if pipeline == self.topo.pipeline:
                continue
            for unit, parts in _by_unit(transfers(mine, theirs), mine):
                sends.setdefault(unit, []).append(_Message(peer, self.topo.pipeline, unit, parts))
            for unit, parts in _by_unit(transfers(theirs, mine), theirs):
                recvs.append(_Message(peer, pipeline, unit, parts))
                for part in parts:
                    covered[part.recv_index][pipeline] += part.numel
        for index, held in enumerate(mine):
            for pipeline, count in enumerate(covered[index]):
                if pipeline != self.topo.pipeline and count != held.numel:
                    raise RuntimeError(
                        f"pipeline {pipeline} holds {count} of the {held.numel} gradient "
                        f"elements of {held.layout.name} that rank {me} holds; every pipeline "
                        "must compute the same model")
        return sends, recvs

    def _links(self, config: BridgeConfig) -> dict[int, Bridge | DirectLink]:
        """The path to each peer: the bridge where device types differ (or it is forced), else
        direct (gloo on the CPU, else the default group when it speaks the chip's library)."""
        plan = self.topo.job_plan
        assert plan is not None
        group = self.topo.pipelines_group
        links: dict[int, Bridge | DirectLink] = {}
        mine = plan.chips[plan.rank_chip(self.topo.rank)].device
        peers = sorted({m.peer for ms in self.sends.values() for m in ms}
                       | {m.peer for m in self.recvs})
        for peer in peers:
            theirs = plan.chips[plan.rank_chip(peer)].device
            direct_backend = ACCELERATORS[mine].dist_backend == dist.get_backend()
            if config.force or theirs != mine:
                links[peer] = Bridge(group, self.device, config, self.stats)
            elif mine == "cpu":
                links[peer] = DirectLink(self.device, self.stats, group)
            elif direct_backend:
                links[peer] = DirectLink(self.device, self.stats)
            else:
                links[peer] = Bridge(group, self.device, config, self.stats)
        return links

    # ---------------------------------------------------------------------------- a step
    def _post_recvs(self) -> None:
        if self._pending_recvs or not self.recvs:
            return
        for message in self.recvs:
            link = self.links[message.peer]
            _, (handle,) = link.post([], [((message.numel,), WIRE_DTYPE, message.peer)])
            self._pending_recvs.append((message, handle))

    def _send_unit(self, unit: int, sources: Callable[[int], tuple[torch.Tensor, int]]) -> None:
        """Post ``unit``'s messages; ``sources(bucket)`` gives the tensor holding a bucket's
        elements and the bucket position of its first element."""
        self._post_recvs()
        self._sent_units.add(unit)
        for message in self.sends.get(unit, []):
            pieces = []
            for part in message.parts:
                held = self.held[part.send_index]
                data, base = sources(held.bucket)
                flat = data[held.offset - base:held.offset - base + held.holding.numel]
                pieces.append(_rect(flat, held.holding, part.send_row, part.send_col,
                                    part.rows, part.cols).reshape(-1).to(WIRE_DTYPE))
            payload = torch.cat(pieces)  # a copy: the gradients change before it has left
            sent, _ = self.links[message.peer].post([(payload, message.peer)], [])
            self._pending_sends.extend(sent)

    def _bucket_source(self, g: int) -> tuple[torch.Tensor, int]:
        """A bucket's reduced elements as the DP sync left them: ``(tensor, first position)``."""
        part, bucket = self.slots[g]
        if part.reduce_scatter and bucket.shard_grad is not bucket.buffer:
            return bucket.shard_grad, bucket.shard_range(part.dp_rank)[0]
        return bucket.buffer, 0

    @property
    def buckets_sent(self) -> int:
        """Buckets whose messages have left during this step so far."""
        return len(self._sent_units - {self.late_unit})

    def bucket_synced(self, bucket: Bucket, part: int = 0) -> None:
        """The DP reduction of ``bucket`` (of set ``part``) has finished: send its complete
        gradients, and those of the buckets after it that were waiting for it (units leave in
        order; the ``on_synced`` callback, during the last backward)."""
        unit = self.unit_of.get(self.first[part] + bucket.index)
        if unit is None:
            return
        self._synced_units.add(unit)
        self._send_in_order(self._synced_units)

    def _send_in_order(self, ready: set[int] | range) -> None:
        """Send the units after those sent (always the first few) up to the first one not
        ``ready``."""
        unit = self.buckets_sent
        while unit < self.late_unit and unit in ready:
            self._send_unit(unit, self._bucket_source)
            unit += 1

    def finish(self) -> None:
        """Complete the sum: send what is left (the deferred buckets, the late parameters),
        wait for every message, add the pipelines' values in pipeline order into the
        optimizer's gradients and, under the replicated optimizer, all-gather each bucket over
        its set's DP group. Call after the DP sync and the TP sum of sequence-parallel
        gradients, on every rank."""
        self._send_in_order(range(self.late_unit))
        grads = self.grads()
        self._send_unit(self.late_unit, lambda g: (grads[g], self._grads_base(g)))
        self._post_recvs()
        incoming = self._receive()
        with torch.no_grad():
            for index, held in enumerate(self.held):
                self._add_in_order(held, incoming[index], grads)
            for g, (part, bucket) in enumerate(self.slots):
                if not part.reduce_scatter and part.dp_group is not None:
                    lo, hi = bucket.shard_range(part.dp_rank)
                    all_gather_flat(grads[g], grads[g][lo:hi].clone(), part.dp_group)
        for handle in self._pending_sends:
            handle.wait()
        self._pending_sends, self._pending_recvs = [], []
        self._sent_units, self._synced_units = set(), set()

    def _grads_base(self, g: int) -> int:
        """Bucket position of the first element of the optimizer's gradient tensor ``g``."""
        part, bucket = self.slots[g]
        return bucket.shard_range(part.dp_rank)[0] if part.reduce_scatter else 0

    def _receive(self) -> list[dict[int, torch.Tensor]]:
        """``[holding][pipeline]``: every other pipeline's values of each holding."""
        incoming: list[dict[int, torch.Tensor]] = [{} for _ in self.held]
        for message, handle in self._pending_recvs:
            payload = handle.wait()
            at = 0
            for part in message.parts:
                held = self.held[part.recv_index]
                into = incoming[part.recv_index].get(message.pipeline)
                if into is None:
                    into = torch.empty(held.holding.numel, dtype=WIRE_DTYPE, device=self.device)
                    incoming[part.recv_index][message.pipeline] = into
                _rect(into, held.holding, part.recv_row, part.recv_col, part.rows,
                      part.cols).copy_(payload[at:at + part.numel].view(part.rows, part.cols))
                at += part.numel
        return incoming

    def _add_in_order(self, held: _Held, others: dict[int, torch.Tensor],
                      grads: list[torch.Tensor]) -> None:
        """``g_0 + g_1 + ...`` in pipeline order into this rank's gradient range."""
        base = self._grads_base(held.bucket)
        own = grads[held.bucket][held.offset - base:held.offset - base + held.holding.numel]
        values = [others.get(k, own) for k in range(self.topo.num_pipelines)]
        total = values[0].to(WIRE_DTYPE, copy=True)
        for value in values[1:]:
            total += value
        own.copy_(total)

    def close(self) -> None:
        """Stop the bridges' stager threads (sends already waited for)."""
        for link in self.links.values():
            link.close()
