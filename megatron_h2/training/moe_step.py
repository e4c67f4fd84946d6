"""What a training step does for the mixture-of-experts layers beyond forward and backward:
the scale of the aux losses' gradients, the expert-bias update, and the step's MoE metrics.

As in Megatron, each micro-batch's aux / z loss gradient is scaled by 1 / (micro-batches of
the global batch) (times the fp16 loss scale), which is what Megatron's 1 / (micro-batches per
DP rank) followed by the DP average of the gradients amounts to. The expert bias moves once per
global batch, from the tokens routed to each expert over the whole global batch.

Every function here that reduces is collective: every rank of the job calls it, MoE stage or
not, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_h2.config import ModelConfig
from megatron_h2.distributed.topology import Topology
from megatron_h2.models.gpt import GPTModel
from megatron_h2.parallel import TPContext


def set_aux_loss_scale(model: GPTModel, micro_batches: int, loss_scale: float | None) -> None:
    """The gradient the aux losses of this step's forwards receive (set before the schedule)."""
    model.moe_state.loss_scale = (1.0 if loss_scale is None else loss_scale) / micro_batches


def _world_sum_(t: torch.Tensor, topo: Topology) -> torch.Tensor:
    if topo.distributed:
        dist.all_reduce(t, group=topo.cpu_group)
    return t


def update_expert_bias(model: GPTModel, config: ModelConfig, topo: Topology,
                       tp: TPContext) -> None:
    """Megatron's auxiliary-loss-free balancing, once per global batch: every router's bias
    moves towards balance by the update rate, from the tokens routed to each of its experts in
    the whole global batch (summed over every data-parallel replica and pipeline, once per TP
    group). Collective when the model balances with an expert bias; else nothing."""
    if not (config.is_moe and config.moe_router_enable_expert_bias):
        return
    counts = torch.zeros(config.num_layers, config.num_experts, dtype=torch.float64)
    routers = {moe.layer: moe.router for moe in model.moe_layers().values()}
    if tp.rank == 0:
        for layer, router in routers.items():
            counts[layer] = router.local_tokens_per_expert.double().cpu()
    _world_sum_(counts, topo)
    for layer, router in routers.items():
        router.update_expert_bias(counts[layer].to(router.expert_bias))


@dataclass
class MoEMetrics:
    """One step's MoE figures, the same on every rank: each loss averaged over the global
    batch's micro-batches, per MoE layer and (as Megatron's log line shows it) over the MoE
    layers; tokens routed to each expert of each MoE layer over the global batch."""

    losses: dict[str, float] = field(default_factory=dict)
    per_layer: dict[str, dict[int, float]] = field(default_factory=dict)
    tokens_per_expert: dict[int, list[int]] = field(default_factory=dict)

    def log_text(self) -> str:
        """Megatron's addition to the iteration line: `` load_balancing_loss: 1.00 |``."""
        return "".join(f" {name}: {value:.2f} |" for name, value in self.losses.items())

    def scalars(self, per_layer: bool) -> dict[str, float]:
        """Named scalars for TensorBoard / JSON lines (Megatron's names; per layer
        ``moe/{name}_layer_{i}``; token counts ``moe/tokens_per_expert/layer_{i}/expert_{e}``)."""
        out = dict(self.losses)
        if per_layer:
            for name, layers in self.per_layer.items():
                out.update({f"moe/{name}_layer_{i}": v for i, v in layers.items()})
        for layer, counts in self.tokens_per_expert.items():
            out.update({f"moe/tokens_per_expert/layer_{layer}/expert_{e}": float(c)
                        for e, c in enumerate(counts)})
        return out


LOSS_NAMES = ("load_balancing_loss", "seq_load_balancing_loss", "z_loss")


def step_metrics(model: GPTModel, config: ModelConfig, topo: Topology, tp: TPContext,
                 micro_batches: int) -> MoEMetrics | None:
    """The step's :class:`MoEMetrics` (collective for MoE models; None for dense ones).
    Clears what the layers recorded."""
    if not config.is_moe:
        return None
    recorded = model.moe_state.take_losses()
    tokens = model.moe_state.take_tokens()
    moe_layers = config.moe_layers
    names = [n for n in LOSS_NAMES if _enabled(n, config)]
    table = torch.zeros(len(names) + config.num_experts, config.num_layers, dtype=torch.float64)
    if tp.rank == 0:
        for row, name in enumerate(names):
            for layer, value in recorded.get(name, {}).items():
                table[row, layer] = value
        for layer, counts in tokens.items():
            table[len(names):, layer] = counts.double().cpu()
    _world_sum_(table, topo)
    out = MoEMetrics()
    for row, name in enumerate(names):
        per_layer = {i: float(table[row, i]) / micro_batches for i in moe_layers}
        out.per_layer[name] = per_layer
        out.losses[name] = sum(per_layer.values()) / len(moe_layers)
    out.tokens_per_expert = {i: [round(float(c)) for c in table[len(names):, i]]
                             for i in moe_layers}
    return out


def _enabled(name: str, config: ModelConfig) -> bool:
    if name == "z_loss":
        return config.moe_z_loss_coeff is not None
    kind = {"load_balancing_loss": "aux_loss", "seq_load_balancing_loss": "seq_aux_loss"}[name]
    return config.moe_router_load_balancing_type == kind and config.moe_aux_loss_coeff > 0
