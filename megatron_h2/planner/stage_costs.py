"""Costs of one stage kind (chip type, TP degree, micro-batch size, DP degree).

:class:`StageCosts` holds per-layer and per-edge times and bytes that
:class:`~megatron_h2.planner.cost_model.CostModel` builds, and answers what a stage of ``l``
layers costs: forward and backward per micro-batch (with the weight-gradient part of the backward
that a zero-bubble schedule defers), peak memory for the activations its schedule keeps in flight
(:mod:`~megatron_h2.planner.held_activations`), and its end-of-step DP sync and optimizer work.
The formulas are documented in ``docs/planner.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from megatron_h2.planner.held_activations import State, Totals


@dataclass(frozen=True)
class StageCosts:
    """Per-layer and per-edge costs of one stage kind: (chip type, TP, micro-batch, DP).

    Times are seconds per micro-batch; memory is bytes per chip. ``layer_backward`` and
    ``layer_activation`` are indexed like :data:`MODES`.
    """

    chip: str
    tensor_parallel_size: int
    micro_batch_size: int
    data_parallel_size: int
    layer_forward: float
    layer_backward: tuple[float, float, float]
    embedding_forward: float
    embedding_backward: float
    head_forward: float
    head_backward: float
    layer_static: float
    embedding_static: float
    head_static: float
    layer_activation: tuple[float, float, float]
    head_activation: float
    working: float
    capacity: float
    layer_params: float
    embedding_params: float
    head_params: float
    sync_per_param: float
    sync_fixed: float
    optimizer_per_param: float = 0.0
    layer_weight_grad: float = 0.0
    """Seconds of a layer's backward that are weight gradients (deferred by zero-bubble)."""
    embedding_weight_grad: float = 0.0
    head_weight_grad: float = 0.0
    layer_weight_inputs: float = 0.0
    """Bytes per layer and micro-batch kept from input gradient to weight gradient."""
    embedding_weight_inputs: float = 0.0
    head_weight_inputs: float = 0.0
    layer_sync: float | None = None
    """Seconds of the end-of-step gradient sync per layer (None: ``layer_params x
    sync_per_param``; a MoE layer's experts sync over the smaller expert-data-parallel group)."""
    _unit_caps: dict[tuple[int, tuple[Totals, ...], bool, bool], tuple[int, ...]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def sync_per_layer(self) -> float:
        """Seconds of the end-of-step gradient sync per layer (when DP > 1)."""
        if self.layer_sync is not None:
            return self.layer_sync
        return self.layer_params * self.sync_per_param

    def blend(self, moe: StageCosts, dense_layers: int, moe_layers: int) -> StageCosts:
        """These costs (of dense layers) and ``moe``'s (of MoE layers, same chip type, TP,
        micro-batch and DP) as one kind whose per-layer numbers are the means over
        ``dense_layers`` + ``moe_layers`` layers: every per-layer term of a stage is linear in
        the layers, so a stage of that many layers costs what the two kinds add up to (the
        working space is the larger kind's, the sync's fixed part the MoE kind's)."""
        total = dense_layers + moe_layers
        if moe_layers == 0 or total == 0:
            return self
        if dense_layers == 0:
            return moe
        a, b = dense_layers / total, moe_layers / total

        def mean(x: float, y: float) -> float:
            return a * x + b * y

        def means(x: tuple[float, ...], y: tuple[float, ...]) -> tuple[float, float, float]:
            return tuple(mean(u, v) for u, v in zip(x, y))  # type: ignore[return-value]

        return replace(
            self,
            layer_forward=mean(self.layer_forward, moe.layer_forward),
            layer_backward=means(self.layer_backward, moe.layer_backward),
            layer_static=mean(self.layer_static, moe.layer_static),
            layer_activation=means(self.layer_activation, moe.layer_activation),
            working=max(self.working, moe.working),
            layer_params=mean(self.layer_params, moe.layer_params),
            sync_fixed=moe.sync_fixed,
            layer_weight_grad=mean(self.layer_weight_grad, moe.layer_weight_grad),
            layer_weight_inputs=mean(self.layer_weight_inputs, moe.layer_weight_inputs),
            layer_sync=mean(self.sync_per_layer, moe.sync_per_layer),
        )

    def layer_time(self, mode: int) -> float:
        """Forward + backward of one layer for one micro-batch under recompute ``MODES[mode]``.

        For bounds and summaries; plan times use :meth:`forward` + :meth:`backward`.
        """
        return self.layer_forward + self.layer_backward[mode]

    def edge_time(self, first: bool, last: bool) -> float:
        """Forward + backward of the embedding (first stage) and head (last stage) per
        micro-batch."""
        time = 0.0
        if first:
            time += self.embedding_forward + self.embedding_backward
        if last:
            time += self.head_forward + self.head_backward
        return time

    def forward(self, layers: int, first: bool, last: bool) -> float:
        """Forward time of a stage for one micro-batch."""
        edge = (self.embedding_forward if first else 0.0) + (self.head_forward if last else 0.0)
        return edge + layers * self.layer_forward

    def backward(self, layers: int, mode: int, first: bool, last: bool) -> float:
        """Backward time (with recompute) of a stage for one micro-batch."""
        edge = (self.embedding_backward if first else 0.0) + (self.head_backward if last else 0.0)
        return edge + layers * self.layer_backward[mode]

    def chunk_times(
        self, layers: int, mode: int, embedding: bool, head: bool
    ) -> tuple[float, float, float]:
        """(forward, backward, weight-gradient part of the backward) of one model chunk of
        ``layers`` layers for one micro-batch; ``embedding`` / ``head``: the chunk holds them."""
        forward = self.forward(layers, embedding, head)
        backward = self.backward(layers, mode, embedding, head)
        weight = layers * self.layer_weight_grad
        weight += (self.embedding_weight_grad if embedding else 0.0) + (
            self.head_weight_grad if head else 0.0
        )
        return forward, backward, weight

    def held_memory(
        self,
        chunk_layers: tuple[int, ...],
        mode: int,
        states: tuple[State, ...],
        first: bool,
        last: bool,
        chunk_costs: tuple[StageCosts, ...] = (),
    ) -> float:
        """Peak bytes per chip of a stage whose chunks hold ``chunk_layers`` layers, over the
        held ``states`` of its schedule (:func:`~megatron_h2.planner.held_activations.held_states`).

        A micro-batch between a chunk's forward and backward keeps the chunk's activations
        (by recompute mode; the head's on the last stage's last chunk); between a zero-bubble
        backward and its weight-gradient work, the weight gradients' inputs instead.
        ``chunk_costs``: per chunk, the costs of its layers where chunks differ (MoE models
        whose chunks mix dense and MoE layers differently; :meth:`blend`), else these costs.
        """
        per_chunk = chunk_costs or (self,) * len(chunk_layers)
        layers = sum(chunk_layers)
        static = sum(n * c.layer_static for n, c in zip(chunk_layers, per_chunk))
        static += max(c.working for c in per_chunk) if layers > 0 else 0.0
        static += (self.embedding_static if first else 0.0) + (self.head_static if last else 0.0)
        acts = [c.layer_activation[mode] for c in per_chunk]
        keeps = [c.layer_weight_inputs for c in per_chunk]
        peak = 0.0
        for active, deferred in states:
            held = sum(n * (a * act + d * keep) for n, a, d, act, keep
                       in zip(chunk_layers, active, deferred, acts, keeps))
            if first:
                held += deferred[0] * self.embedding_weight_inputs
            if last:
                held += active[-1] * self.head_activation + deferred[-1] * self.head_weight_inputs
            peak = max(peak, held)
        return static + peak

    def totals_memory(
        self,
        units: int,
        chunks: int,
        mode: int,
        totals: tuple[Totals, ...],
        first: bool,
        last: bool,
    ) -> float:
        """:meth:`held_memory` of a stage with ``units`` layers in each of its ``chunks`` chunks,
        from the held totals (:func:`~megatron_h2.planner.held_activations.held_totals`)."""
        layers = units * chunks
        static = layers * self.layer_static + (self.working if layers > 0 else 0.0)
        static += (self.embedding_static if first else 0.0) + (self.head_static if last else 0.0)
        act, keep, peak = self.layer_activation[mode], self.layer_weight_inputs, 0.0
        for active, deferred, head_active, head_deferred, embedding_deferred in totals:
            held = units * (active * act + deferred * keep)
            held += head_active * self.head_activation + head_deferred * self.head_weight_inputs
            held += embedding_deferred * self.embedding_weight_inputs
            peak = max(peak, held)
        return static + peak

    def max_units(
        self, chunks: int, mode: int, totals: tuple[Totals, ...], first: bool, last: bool
    ) -> int:
        """Most layers per chunk (all ``chunks`` chunks equal) that fit the chip's memory with
        the held ``totals`` (-1 if not even the embedding / head fit)."""
        if self.totals_memory(0, chunks, mode, totals, first, last) > self.capacity:
            return -1
        fixed = self.working + (self.embedding_static if first else 0.0)
        fixed += self.head_static if last else 0.0
        act, keep, most = self.layer_activation[mode], self.layer_weight_inputs, 1 << 20
        for active, deferred, head_active, head_deferred, embedding_deferred in totals:
            per = chunks * self.layer_static + active * act + deferred * keep
            edge = head_active * self.head_activation + head_deferred * self.head_weight_inputs
            edge += embedding_deferred * self.embedding_weight_inputs
            if per > 0:
                most = min(most, max(int((self.capacity - fixed - edge) // per), 0))
        memory = self.totals_memory
        while most > 0 and memory(most, chunks, mode, totals, first, last) > self.capacity:
            most -= 1
        while most < 1 << 20 and memory(most + 1, chunks, mode, totals, first, last) <= (
            self.capacity
        ):
            most += 1
        return most

    def unit_caps(
        self, chunks: int, totals: tuple[Totals, ...], first: bool, last: bool
    ) -> tuple[int, ...]:
        """:meth:`max_units` per recompute mode (indexed like ``MODES``; cached: every batch
        shape with this stage kind asks for the same held totals again and again)."""
        key = (chunks, totals, first, last)
        caps = self._unit_caps.get(key)
        if caps is None:
            modes = range(len(self.layer_activation))
            caps = tuple(self.max_units(chunks, mode, totals, first, last) for mode in modes)
            self._unit_caps[key] = caps
        return caps

    def edge_memory(self, in_flight: int, first: bool, last: bool) -> float:
        """Bytes of the embedding and head (weights, optimizer, head activations) on the stage."""
        memory = 0.0
        if first:
            memory += self.embedding_static
        if last:
            memory += self.head_static + in_flight * self.head_activation
        return memory

    def memory(self, layers: int, mode: int, in_flight: int, first: bool, last: bool) -> float:
        """Peak bytes per chip of a stage holding ``in_flight`` micro-batches of activations."""
        per_layer = self.layer_static + in_flight * self.layer_activation[mode]
        working = self.working if layers > 0 else 0.0
        return self.edge_memory(in_flight, first, last) + working + layers * per_layer

    def max_layers(self, mode: int, in_flight: int, first: bool, last: bool) -> int:
        """Most layers that fit the chip's memory (-1 if not even the embedding/head fit)."""
        if self.memory(0, mode, in_flight, first, last) > self.capacity:
            return -1
        per_layer = self.layer_static + in_flight * self.layer_activation[mode]
        room = self.capacity - self.edge_memory(in_flight, first, last) - self.working
        guess = max(int(room // per_layer), 0) if per_layer > 0 else 1 << 20
        while guess > 0 and self.memory(guess, mode, in_flight, first, last) > self.capacity:
            guess -= 1
        while (
            self.memory(guess + 1, mode, in_flight, first, last) <= self.capacity
            and guess < 1 << 20
        ):
            guess += 1
        return guess

    def params(self, layers: int, first: bool, last: bool) -> float:
        """Parameters per chip of a stage."""
        edge = (self.embedding_params if first else 0.0) + (self.head_params if last else 0.0)
        return edge + layers * self.layer_params

    def optimizer_step(self, layers: int, first: bool, last: bool) -> float:
        """Seconds of the once-per-step optimizer work (0 unless the profile measures it)."""
        return self.params(layers, first, last) * self.optimizer_per_param

    def dp_sync(self, layers: int, first: bool, last: bool) -> float:
        """Seconds of the once-per-step gradient synchronisation across the DP replicas."""
        if self.data_parallel_size == 1:
            return 0.0
        edge = self.params(0, first, last) * self.sync_per_param
        return self.sync_fixed + edge + layers * self.sync_per_layer
