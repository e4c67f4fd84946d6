"""The MoE router: top-k routing with Megatron-Core's score functions, group-limited routing,
expert capacity, and the load-balancing (aux / sequence aux) and z losses.

Formulas follow Megatron-Core's ``moe_utils`` (``topk_routing_with_score_function``,
``group_limited_topk``, ``apply_router_token_dropping``, ``switch_load_balancing_loss_func``,
``z_loss_func``, ``get_updated_expert_bias``). Tokens are routed in Megatron's order: sequence
first, [s, b] flattened to s x b rows, so "position" token dropping drops the same tokens.

The losses never enter the language-model loss: as Megatron's ``MoEAuxLossAutoScaler``, an
autograd function attaches each to the routing probabilities (or logits) and adds its gradient,
times :attr:`MoEState.loss_scale` (1 / micro-batches of the global batch, times the fp16 loss
scale), in the backward. E = experts, T = tokens of the micro-batch, k = top-k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from megatron_h2.config import ModelConfig

_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


@dataclass
class MoEState:
    """What the MoE layers of one stage model share with the training step: the scale of the
    aux losses' gradients, and the losses recorded per layer for logging (detached sums over
    the step's micro-batches, ``{name: {layer: value}}``)."""

    loss_scale: float = 1.0
    losses: dict[str, dict[int, float]] = field(default_factory=dict)
    tokens: dict[int, torch.Tensor] = field(default_factory=dict)
    """Tokens routed to each expert [E] per layer, summed over the step's forwards."""

    def count_tokens(self, layer: int, counts: torch.Tensor) -> None:
        if layer in self.tokens:
            self.tokens[layer] = self.tokens[layer] + counts.detach()
        else:
            self.tokens[layer] = counts.detach().clone()

    def take_tokens(self) -> dict[int, torch.Tensor]:
        """The token counts since the last call, cleared."""
        out, self.tokens = self.tokens, {}
        return out

    def record(self, name: str, layer: int, value: torch.Tensor) -> None:
        per_layer = self.losses.setdefault(name, {})
        per_layer[layer] = per_layer.get(layer, 0.0) + float(value.detach())

    def take_losses(self) -> dict[str, dict[int, float]]:
        """The recorded losses since the last call, cleared."""
        out, self.losses = self.losses, {}
        return out


class AuxLossAutoScaler(torch.autograd.Function):
    """Identity on ``output``; the backward also gives ``aux_loss`` the gradient ``scale``."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss) * ctx.scale, None


def in_backward_recompute() -> bool:
    """True while activation recompute re-runs a forward inside the backward (counts and
    logged losses must not be taken twice)."""
    return torch._C._current_graph_task_id() != -1


def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k among the experts of each token's best ``group_topk`` groups (groups ranked by
    the sum of their top-(k / group_topk) scores). scores [T, E] -> (values, indices) [T, k]."""
    tokens, experts = scores.shape
    group_scores = scores.view(tokens, num_groups, -1).topk(topk // group_topk, dim=-1)[0]
    group_idx = torch.topk(group_scores.sum(dim=-1), k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros(tokens, num_groups, dtype=scores.dtype, device=scores.device)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(tokens, num_groups, experts // num_groups)
    masked = scores.masked_fill(~score_mask.reshape(tokens, -1).bool(), float("-inf"))
    return torch.topk(masked, k=topk, dim=-1)


def topk_routing(logits: torch.Tensor, config: ModelConfig,
                 expert_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing probabilities [T, E] (zero off the top-k) and routing map [T, E] (bool)."""
    k = config.moe_router_topk
    groups, group_topk = config.moe_router_num_groups, config.moe_router_group_topk

    def topk(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if group_topk:
            return group_limited_topk(scores, k, groups, group_topk)
        return torch.topk(scores, k=k, dim=1)

    function = config.moe_router_score_function
    if function == "softmax":
        if config.moe_router_pre_softmax:
            probs, indices = topk(torch.softmax(logits, dim=-1, dtype=torch.float32))
        else:
            scores, indices = topk(logits)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:
        scores = (torch.sigmoid(logits.float()) if function == "sigmoid"
                  else F.softplus(logits.float()).sqrt())
        if expert_bias is not None:
            _, indices = topk(scores + expert_bias.float())
            scores = torch.gather(scores, dim=1, index=indices)
        else:
            scores, indices = topk(scores)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if k > 1 else scores
    if config.moe_router_topk_scaling_factor:
        probs = probs * config.moe_router_topk_scaling_factor
    probs = probs.type_as(logits)
    routing_probs = torch.zeros_like(logits).scatter(1, indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.int32).scatter(1, indices, 1).bool()
    return routing_probs, routing_map


def expert_capacity(num_tokens: int, config: ModelConfig) -> int:
    """Tokens each expert takes: ceil(T x k / E x capacity factor), as Megatron."""
    return math.ceil(num_tokens * config.moe_router_topk / config.num_experts
                     * config.moe_expert_capacity_factor)


def drop_tokens(probs: torch.Tensor, routing_map: torch.Tensor, config: ModelConfig
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert keeps at most its capacity of tokens: those of highest probability
    (``probs``) or the first ones in [s, b] order (``position``); with padding to capacity
    the map becomes exactly ``capacity`` tokens per expert (padded ones with probability 0)."""
    capacity = expert_capacity(probs.shape[0], config)
    if capacity > probs.shape[0]:
        mask = torch.ones_like(routing_map)
    elif config.moe_token_drop_policy == "probs":
        _, index = torch.topk(probs, k=capacity, dim=0, sorted=False)
        mask = torch.zeros_like(probs).scatter(0, index, 1).bool()
    else:  # the first routed tokens (Megatron's top-k over the 0/1 map, ties broken by order)
        position = routing_map.int().cumsum(dim=0)  # [T, E]: 1-based rank of a routed token
        mask = (position <= capacity) & routing_map
    final_map = mask if config.moe_pad_expert_input_to_capacity else routing_map & mask
    return probs * final_map, final_map


def switch_aux_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor, total_tokens: int,
                    config: ModelConfig, coeff: float) -> torch.Tensor:
    """E x coeff / (k T^2) x sum_i (sum_t scores[t, i]) x tokens_per_expert[i]."""
    e, k = config.num_experts, config.moe_router_topk
    return torch.sum(scores.sum(dim=0) * tokens_per_expert) * (
        e * coeff / (k * total_tokens * total_tokens))


def aux_loss_scores(logits: torch.Tensor, config: ModelConfig
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing map [T, E] of the plain top-k, normalised scores [T, E] fp32) the aux losses
    are computed from (no expert bias, no groups, no dropping)."""
    function = config.moe_router_score_function
    if function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = (torch.sigmoid(logits.float()) if function == "sigmoid"
                  else F.softplus(logits.float()).sqrt())
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    _, indices = torch.topk(scores, k=config.moe_router_topk, dim=1)
    routing_map = torch.zeros_like(logits, dtype=torch.int32).scatter(1, indices, 1).bool()
    return routing_map, scores


class TopKRouter(nn.Module):
    """Megatron-Core's ``TopKRouter``: ``weight`` [E, h] (and ``bias`` [E] with linear biases);
    with ``--moe-router-enable-expert-bias`` the buffer ``expert_bias`` [E] (fp32, saved) and the
    tokens routed to each expert since the last update, ``local_tokens_per_expert``."""

    def __init__(self, config: ModelConfig, layer: int, state: MoEState) -> None:
        super().__init__()
        e = config.num_experts
        self.config, self.layer, self.state = config, layer, state
        self.weight = nn.Parameter(torch.empty(e, config.hidden_size))
        self.bias = nn.Parameter(torch.zeros(e)) if config.add_bias_linear else None
        self.dtype = _ROUTER_DTYPES.get(config.moe_router_dtype)
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(e, dtype=torch.float32))
            self.register_buffer("local_tokens_per_expert", torch.zeros(e, dtype=torch.float32),
                                 persistent=False)
        else:
            self.expert_bias = self.local_tokens_per_expert = None

    def gating(self, x: torch.Tensor) -> torch.Tensor:
        """[T, h] -> logits [T, E] (in --moe-router-dtype when set)."""
        dtype = self.dtype or x.dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(x.to(dtype), self.weight.to(dtype), bias)

    def _attach(self, target: torch.Tensor, loss: torch.Tensor, name: str, coeff: float
                ) -> torch.Tensor:
        if not in_backward_recompute():
            self.state.record(name, self.layer, loss / coeff)
        return AuxLossAutoScaler.apply(target, loss, self.state.loss_scale)

    def forward(self, x: torch.Tensor, seq_length: int, batch: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, h] with T = s x b tokens in [s, b] order -> (probs [T, E], routing map
        [T, E] bool)."""
        cfg = self.config
        logits = self.gating(x)  # [T, E]
        training = self.training and torch.is_grad_enabled()
        if training and cfg.moe_z_loss_coeff is not None:
            z_loss = torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) \
                * cfg.moe_z_loss_coeff
            logits = self._attach(logits, z_loss, "z_loss", cfg.moe_z_loss_coeff)
        probs, routing_map = topk_routing(logits, cfg, self.expert_bias)
        if cfg.moe_expert_capacity_factor is not None:
            probs, routing_map = drop_tokens(probs, routing_map, cfg)
        coeff, kind = cfg.moe_aux_loss_coeff, cfg.moe_router_load_balancing_type
        if training and coeff > 0 and kind in ("aux_loss", "seq_aux_loss"):
            aux_map, scores = aux_loss_scores(logits, cfg)
            if kind == "aux_loss":
                loss = switch_aux_loss(scores, aux_map.sum(dim=0), aux_map.shape[0], cfg, coeff)
                probs = self._attach(probs, loss, "load_balancing_loss", coeff)
            else:  # per sequence: the batch folded into the expert dimension
                scores, aux_map = scores.reshape(seq_length, -1), aux_map.reshape(seq_length, -1)
                loss = switch_aux_loss(scores, aux_map.sum(dim=0), seq_length, cfg, coeff) / batch
                probs = self._attach(probs, loss, "seq_load_balancing_loss", coeff)
        if self.local_tokens_per_expert is not None and training and \
                not in_backward_recompute():
            with torch.no_grad():
                self.local_tokens_per_expert += routing_map.sum(dim=0)
        return probs, routing_map

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """Megatron's rule: each expert's bias moves by the update rate towards balance,
        bias += rate x sign(mean tokens - its tokens); ``tokens_per_expert`` are the counts of
        the whole global batch. Clears the local counts."""
        mean = tokens_per_expert.sum() / tokens_per_expert.shape[-1]
        offset = mean - tokens_per_expert
        self.expert_bias += torch.sign(offset) * self.config.moe_router_bias_update_rate
        self.local_tokens_per_expert.zero_()
