"""The mixture-of-experts terms of the cost model (docs/planner.md, "Mixture-of-experts
layers"): the search's bound costs for models with dense and MoE layers, the EP degrees a stage
may take, a stage's costs by the layers it holds, the dispatch all-to-all and a MoE layer's
compute. :class:`MoECosts` is a base of :class:`~megatron_h2.planner.cost_model.CostModel`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from megatron_h2.config import ModelConfig
from megatron_h2.errors import ConfigError
from megatron_h2.plan.schema import StageSpec
from megatron_h2.planner.cluster import ChipType, Cluster
from megatron_h2.planner.stage_costs import StageCosts

if TYPE_CHECKING:
    from megatron_h2.planner.cost_model import CostConfig


class MoECosts:
    """Mixture-of-experts terms, read from the cost model's model, cluster and config."""

    model: ModelConfig
    cluster: Cluster
    config: CostConfig
    layer_is_moe: tuple[bool, ...]
    _kinds: dict

    def stage_costs(self, chip_name: str, tp: int, mbs: int, dp: int, ep: int = 1,
                    moe: bool | None = None, etp: int | None = None) -> StageCosts:
        raise NotImplementedError

    def _bandwidth(self, gb_per_s: float) -> float:
        raise NotImplementedError

    def _compute_times(self, chip: ChipType, tp: int, mbs: int
                       ) -> tuple[float, float, float, float, float, float]:
        raise NotImplementedError

    def bound_costs(self, chip_name: str, tp: int, mbs: int, dp: int, ep: int) -> StageCosts:
        """For a model with dense and MoE layers: every per-layer time, activation and sync
        term the smaller of the two kinds' (a stage of ``l`` layers costs at least ``l`` such
        layers, which keeps the search's bounds valid; splits are costed exactly by layer kind).
        The weights' and optimizer's bytes per layer are the larger kind's, less a fixed credit
        of what the model's ``D`` layers of the smaller kind save (a stage holds at most ``D`` of
        them), which keeps the memory caps of MoE-heavy models tight and still a bound."""
        key = (chip_name, tp, mbs, dp, ep, None)
        if key not in self._kinds:  # type: ignore[comparison-overlap]
            dense = self.stage_costs(chip_name, tp, mbs, dp, ep, False)
            moe = self.stage_costs(chip_name, tp, mbs, dp, ep, True)
            low = dense.blend(moe, 1, 1)  # sets layer_sync; every per-layer term replaced below
            fields = {name: min(getattr(dense, name), getattr(moe, name))
                      for name in ("layer_forward", "layer_static", "working", "layer_params",
                                   "sync_fixed", "layer_weight_grad", "layer_weight_inputs")}
            for name in ("layer_backward", "layer_activation"):
                fields[name] = tuple(map(min, getattr(dense, name), getattr(moe, name)))
            fields["layer_sync"] = min(dense.sync_per_layer, moe.sync_per_layer)
            few, many = sorted((dense, moe), key=lambda c: c.layer_static)
            count = sum(self.layer_is_moe) if few is moe else \
                len(self.layer_is_moe) - sum(self.layer_is_moe)
            fields["layer_static"] = many.layer_static
            fields["working"] -= count * (many.layer_static - few.layer_static)
            self._kinds[key] = replace(low, **fields)  # type: ignore[index]
        return self._kinds[key]  # type: ignore[index]

    def stage_expert_parallel(self, spec: StageSpec, dp: int) -> int:
        """The EP degree of a plan's stage, checked against what the cost model models: EP
        dividing the experts and the stage's ``TP x DP`` ranks over its experts' TP degree
        (:meth:`stage_expert_tp`)."""
        ep, tp, etp = spec.expert_model_parallel_size, spec.tensor_parallel_size, \
            self.stage_expert_tp(spec)
        if ep not in self.expert_parallel_options(tp, dp, etp):
            raise ConfigError(f"expert_model_parallel_size {ep} must divide the stage's TP x DP "
                              f"ranks over its expert TP ({tp * dp} / {etp}) and the experts "
                              f"({self.model.num_experts}); pick such a degree")
        return ep

    def stage_expert_tp(self, spec: StageSpec) -> int:
        """The experts' TP degree of a plan's stage: ``expert_tensor_parallel_size``, default
        the stage's TP."""
        return spec.expert_tp

    def expert_parallel_options(self, tp: int, dp: int, etp: int | None = None) -> list[int]:
        """EP degrees a stage of TP ``tp`` and DP ``dp`` may take: 1 for a dense model, else
        the divisors of ``--num-experts`` that divide the stage's ``TP x DP`` ranks over the
        experts' TP degree ``etp`` (default the stage's TP, Megatron's default: then the
        divisors of ``dp``)."""
        experts = self.model.num_experts
        if experts is None:
            return [1]
        etp = etp or tp
        if (tp * dp) % etp:
            return []
        ranks = tp * dp // etp
        return [e for e in range(1, ranks + 1) if ranks % e == 0 and experts % e == 0]

    def stage_layer_costs(
        self, chip_name: str, tp: int, mbs: int, dp: int, ep: int, layers: Sequence[int],
        etp: int | None = None,
    ) -> StageCosts:
        """The costs of a stage kind for the global ``layers`` it runs (dense and MoE layers
        blended by count: :meth:`StageCosts.blend`); ``etp``: the experts' TP degree (default
        ``tp``)."""
        moe = sum(self.layer_is_moe[i] for i in layers)
        dense = self.stage_costs(chip_name, tp, mbs, dp, ep, False)
        if moe == 0:
            return dense
        return dense.blend(self.stage_costs(chip_name, tp, mbs, dp, ep, True, etp),
                           len(layers) - moe, moe)

    def alltoall_s(self, nbytes: float, group: int, chip: ChipType) -> float:
        """All-to-all of ``nbytes`` per chip over ``group`` chips (the EP group, intra-node when
        ``group`` divides the chip type's node): the share ``(group - 1) / group`` leaves it."""
        if group <= 1:
            return 0.0
        gb_per_s = chip.intra_node_gb_per_s if chip.chips_per_node % group == 0 \
            else chip.inter_node_gb_per_s
        return (group - 1) * self.config.collective_latency_s + \
            nbytes * (group - 1) / group / self._bandwidth(gb_per_s)

    def expert_tp_exchange_s(self, nbytes: float, etp: int, chip: ChipType) -> float:
        """One all-gather (or reduce-scatter) over an expert-TP group of ``etp`` chips
        (consecutive ranks: intra-node when ``etp`` divides the chip type's node), each holding
        ``nbytes`` of dispatched rows: each receives (sends) ``etp - 1`` such shares."""
        if etp <= 1:
            return 0.0
        gb_per_s = chip.intra_node_gb_per_s if chip.chips_per_node % etp == 0 \
            else chip.inter_node_gb_per_s
        return (etp - 1) * (self.config.collective_latency_s + nbytes / self._bandwidth(gb_per_s))

    def _layer_terms(
        self, chip: ChipType, tp: int, mbs: int, ep: int, moe: bool, etp: int | None = None
    ) -> tuple[float, float, float, float]:
        """(compute forward, all-to-all per direction, weight-gradient FLOP share, attention
        core's FLOP share) of one layer; compute from FLOPs (or the profile's times for dense
        layers). With ``etp`` other than ``tp``, each TP rank dispatches its 1/TP of the
        micro-batch's tokens and the "all-to-all" term adds the all-gather of the dispatched
        rows over the expert-TP group (the reduce-scatter of the outputs takes as long, on the
        combine's side); the expert FLOPs per chip stay those of ETP = TP (the stage's expert
        work spread evenly over its chips)."""
        model, tokens = self.model, mbs * self.model.seq_length
        core = model.attention_core_flops_per_token() * tokens
        if not moe:
            forward = self._compute_times(chip, tp, mbs)[0]
            flops = model.layer_forward_flops(tokens)
            return forward, 0.0, model.layer_weight_grad_flops(tokens) / (2.0 * flops), \
                core / flops
        imbalance = self.config.moe_imbalance if ep > 1 else 1.0
        rest, experts = model.moe_layer_forward_flops(tokens)
        efficiency = self.config.compute_efficiency
        rate = tp * chip.tflops_bf16 * 1e12 * efficiency / chip.emulate_slowdown
        forward = (rest + experts * imbalance) / rate
        # every TP rank dispatches all the micro-batch's tokens (the runtime's MoE layer
        # gathers the sequence over TP first: models/gpt/moe_layer.py)
        dispatched = model.moe_dispatch_bytes(tokens) * imbalance
        if etp is not None and etp != tp:  # each TP rank its share, then the ETP all-gather
            dispatched /= tp
            alltoall = self.alltoall_s(dispatched, ep, chip) + \
                self.expert_tp_exchange_s(dispatched, etp, chip)
        else:
            alltoall = self.alltoall_s(dispatched, ep, chip)
        flops = rest + experts
        return forward, alltoall, model.moe_layer_weight_grad_flops(tokens) / (2.0 * flops), \
            core / flops

