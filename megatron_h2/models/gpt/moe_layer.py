"""The mixture-of-experts block that replaces the MLP of a MoE layer (Megatron-Core's
``MoELayer`` with its local layer spec).

Parameter names are Megatron-Core's: ``mlp.router.weight``, ``mlp.experts.local_experts.{e}
.linear_fc1.weight`` / ``linear_fc2.weight`` (``e`` the *global* expert index, so checkpoints do
not depend on the layout) and, with ``--moe-shared-expert-intermediate-size``,
``mlp.shared_experts.linear_fc1.weight`` / ``linear_fc2.weight`` (and ``gate_weight`` with
``--moe-shared-expert-gate``).

The forward: the shared experts (if any) on the input, the router on the tokens in [s, b]
order, the tokens permuted so that each expert's are contiguous (in token order), each expert's
MLP with its tokens' probabilities applied as Megatron applies them, and the outputs summed back
per token (scatter-add in expert order), plus the shared experts' output.

Under expert parallelism (an :class:`EPContext` of size P) a rank holds the experts
``ep.local_experts(E)`` only and its routed tokens go all-to-all to the experts' ranks and back
(:mod:`megatron_h2.parallel.expert_parallel`; ``--moe-token-dispatcher-type allgather``: every
rank gathers the group's tokens instead and the outputs are summed back); the expert
parameters carry ``param.expert_parallel = True`` (their gradients are summed over the
expert-data-parallel group, the others' over the data-parallel group).

Under sequence parallelism (TP > 1) the block receives this rank's sequence chunk [b, s/t, h]:
it gathers the whole sequence over the TP group first, so that the router, its aux-loss
statistics, capacity and dispatch see the tokens they see without sequence parallelism, runs
the experts (and shared experts) as tensor-parallel MLPs on the replicated tokens and keeps its
own chunk of the output. (Megatron-Core routes the local chunk and gathers over TP in its
dispatchers, summing the aux-loss statistics over TP; gathering first gives the same routing
at the price of every TP rank routing the whole sequence, as it does without SP.)

With an expert-TP context of its own (``etp``: Megatron-Core's ``--expert-tensor-parallel-size``
other than TP) each local expert's ``linear_fc1`` is split by columns (the gate and up halves
each under SwiGLU) and ``linear_fc2`` by rows over the ETP group (with ETP 1, whole on every
rank); under TP > 1 each TP rank dispatches its 1/TP of the routed tokens (rows in [s, b]
order; Megatron-Core's ranks dispatch their sequence-parallel chunk) and the outputs are
all-gathered over TP; the rows that reach a rank are all-gathered over the ETP group, each rank
runs its shards and the partial outputs are reduce-scattered back
(:func:`megatron_h2.parallel.expert_parallel.gather_over_expert_tp`). ``linear_fc2``'s bias is
replicated over the group: each rank adds 1/ETP of it (times the routing probability) to its
partial output, and its gradient, complete on every rank (each rank sees every gathered row's
output gradient), passes unscaled.

Shapes: b = micro-batch size, s = sequence length, h = hidden size, T = s x b tokens,
E = experts, n_e = tokens routed to expert e.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from megatron_h2.config import ModelConfig
from megatron_h2.devices.kernels import Kernels
from megatron_h2.models.gpt.layers import MLP
from megatron_h2.models.gpt.router import MoEState, TopKRouter, in_backward_recompute
from megatron_h2.parallel import (
    TPContext,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron_h2.parallel.expert_parallel import (
    EXPERT_PARALLEL_ATTR,
    EPContext,
    allgather_to_experts,
    dispatch_to_experts,
    gather_over_expert_tp,
)


def permute(tokens: torch.Tensor, routing_map: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [T, h], routing map [T, E] -> (permuted tokens [sum n_e, h], their source rows):
    expert 0's tokens in token order, then expert 1's, ..."""
    num_tokens = routing_map.shape[0]
    token_index = torch.arange(num_tokens, device=routing_map.device)
    rows = token_index.unsqueeze(0).expand(routing_map.shape[1], -1)  # [E, T]
    sorted_rows = rows.masked_select(routing_map.t())  # [sum n_e]
    return tokens.index_select(0, sorted_rows), sorted_rows


def unpermute(expert_out: torch.Tensor, sorted_rows: torch.Tensor, num_tokens: int
              ) -> torch.Tensor:
    """[sum n_e, h] -> [T, h]: each token's expert outputs summed (in expert order)."""
    out = torch.zeros(num_tokens, expert_out.shape[-1], dtype=expert_out.dtype,
                      device=expert_out.device)
    return out.index_add(0, sorted_rows, expert_out)


class _ShareOfBias(torch.autograd.Function):
    """``bias * share`` forward; the gradient passes unscaled (each of the 1 / ``share`` expert-TP
    ranks adds its share, and each sees the whole output gradient)."""

    @staticmethod
    def forward(ctx, bias: torch.Tensor, share: float) -> torch.Tensor:
        return bias * share

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def partial_expert(mlp: MLP, x: torch.Tensor, scale: torch.Tensor, etp_size: int
                   ) -> torch.Tensor:
    """One expert's shards on rows ``x`` [n, h] with routing probabilities ``scale`` [n], no
    communication: [n, h] -> [n, fc1/e] -> [n, f/e] -> [n, h], this rank's partial sum over
    its f/e hidden features (plus 1/e of the scaled ``linear_fc2`` bias)."""
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    inter = mlp.activation(F.linear(x, fc1.weight, fc1.bias))  # [n, f/e]
    inter = (inter * scale.unsqueeze(-1)).to(inter.dtype)
    out = F.linear(inter, fc2.weight)  # [n, h]
    if fc2.bias is None:
        return out
    bias = _ShareOfBias.apply(fc2.bias, 1.0 / etp_size)
    return (out + bias.unsqueeze(0) * scale.unsqueeze(-1)).to(out.dtype)


class SequentialMLP(nn.Module):
    """The experts of one MoE layer, ``local_experts`` keyed by global expert index, run one
    after the other on their contiguous tokens; with ``gather`` their shards over the
    expert-TP group ``tp`` on the group's gathered rows."""

    def __init__(self, config: ModelConfig, kernels: Kernels, tp: TPContext,
                 experts: range, gather: bool = False) -> None:
        super().__init__()
        self.local_experts = nn.ModuleDict({
            str(e): MLP(config, kernels, tp, ffn_hidden_size=config.moe_ffn_hidden_size)
            for e in experts})
        for param in self.local_experts.parameters():
            setattr(param, EXPERT_PARALLEL_ATTR, True)
        self.gather_tp = tp if gather and tp.size > 1 else None

    def forward(self, tokens: torch.Tensor, tokens_per_expert: list[int],
                probs: torch.Tensor) -> torch.Tensor:
        """tokens [sum n_e, h], probs [sum n_e] -> [sum n_e, h] (each row times its prob)."""
        if self.gather_tp is not None:
            return gather_over_expert_tp(tokens, tokens_per_expert, probs, self.gather_tp,
                                         self._partial)
        outputs = [expert(x, per_token_scale=p) for expert, x, p in zip(
            self.local_experts.values(), torch.split(tokens, tokens_per_expert),
            torch.split(probs, tokens_per_expert))]
        return torch.cat(outputs, dim=0)

    def _partial(self, tokens: torch.Tensor, tokens_per_expert: list[int],
                 probs: torch.Tensor) -> torch.Tensor:
        assert self.gather_tp is not None
        outputs = [partial_expert(expert, x, p, self.gather_tp.size) for expert, x, p in zip(
            self.local_experts.values(), torch.split(tokens, tokens_per_expert),
            torch.split(probs, tokens_per_expert))]
        return torch.cat(outputs, dim=0)


class SharedExpertMLP(MLP):
    """The shared experts: an MLP every token goes through; with ``--moe-shared-expert-gate``
    its output is scaled by sigmoid(x . ``gate_weight``) per token (``gate_weight`` [1, h])."""

    def __init__(self, config: ModelConfig, kernels: Kernels, tp: TPContext) -> None:
        super().__init__(config, kernels, tp,
                         ffn_hidden_size=config.moe_shared_expert_intermediate_size)
        self.gate_weight = (nn.Parameter(torch.empty(1, config.hidden_size))
                            if config.moe_shared_expert_gate else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)  # [T, h]
        if self.gate_weight is None:
            return out
        return out * torch.sigmoid(F.linear(x, self.gate_weight))  # [T, h] x [T, 1]


class MoELayer(nn.Module):
    """Router, experts and optional shared experts of one layer. [b, s, h] -> [b, s, h]."""

    def __init__(self, config: ModelConfig, kernels: Kernels, tp: TPContext, layer: int,
                 state: MoEState, ep: EPContext | None = None,
                 etp: TPContext | None = None) -> None:
        """``etp``: the experts' TP context where it differs from ``tp`` (ETP != TP)."""
        super().__init__()
        self.ep = ep = ep or EPContext.single()
        # under SP the block gathers the sequence: its MLPs run on replicated tokens
        self.sp_tp = tp if tp.size > 1 and tp.sequence_parallel else None
        tp = dataclasses.replace(tp, sequence_parallel=False)
        gather = etp is not None and etp.size != tp.size
        # ETP != TP on TP > 1: the TP ranks hold the same tokens; each dispatches its 1/TP
        self.share_tp = tp if gather and tp.size > 1 else None
        self.config, self.layer, self.state = config, layer, state
        self.router = TopKRouter(config, layer, state)
        self.experts = SequentialMLP(config, kernels, etp if gather else tp,
                                     ep.local_experts(config.num_experts), gather=gather)
        self.shared_experts = (SharedExpertMLP(config, kernels, tp)
                               if config.moe_shared_expert_intermediate_size else None)

    def _run_local(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
                   ) -> torch.Tensor:
        """The local experts on ``tokens`` [N, h] routed by ``routing_map`` [N, L] (this rank's
        experts' columns) with ``probs`` [N, L] -> [N, h], each token's outputs summed."""
        permuted, rows = permute(tokens, routing_map)
        permuted_probs = probs.t().contiguous().masked_select(routing_map.t())
        out = self.experts(permuted, routing_map.sum(dim=0).tolist(), permuted_probs)
        return unpermute(out, rows, tokens.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sp_tp is None:
            return self._forward(x)
        # [b, s/t, h] -> [b, s, h]; the grads that come back are complete on every TP rank
        full = gather_from_sequence_parallel_region(x, self.sp_tp, reduce_grads=False)
        return scatter_to_sequence_parallel_region(self._forward(full), self.sp_tp)

    def _dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
                  ) -> torch.Tensor:
        """The routed experts' outputs for ``tokens`` [N, h] (``probs``, ``routing_map`` [N, E])
        -> [N, h], each token's expert outputs summed, through the EP group's dispatch."""
        if self.ep.size > 1 and self.config.moe_token_dispatcher_type == "allgather":
            return allgather_to_experts(tokens, probs, routing_map, self.ep, self._run_local)
        permuted, rows = permute(tokens, routing_map)  # [sum n_e, h]
        permuted_probs = probs.t().contiguous().masked_select(routing_map.t())  # [sum n_e]
        expert_out = dispatch_to_experts(permuted, permuted_probs, routing_map.sum(dim=0),
                                         self.ep, self.experts)  # [sum n_e, h]
        return unpermute(expert_out, rows, tokens.shape[0])

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block on the whole sequence: [b, s, h] -> [b, s, h]."""
        b, s, h = x.shape
        tokens = x.transpose(0, 1).reshape(s * b, h)  # [T, h] in Megatron's [s, b] order
        shared = self.shared_experts(tokens) if self.shared_experts is not None else None
        probs, routing_map = self.router(tokens, s, b)  # [T, E] each
        counts = routing_map.sum(dim=0)  # [E]
        if self.training and torch.is_grad_enabled() and not in_backward_recompute():
            self.state.count_tokens(self.layer, counts)
        share = self.share_tp
        if share is None:
            out = self._dispatch(tokens, probs, routing_map)  # [T, h]
        else:  # this TP rank's 1/TP of the tokens (rows in [s, b] order) go to the experts
            mine = self._dispatch(
                scatter_to_sequence_parallel_region(tokens.unsqueeze(0), share)[0],
                scatter_to_sequence_parallel_region(probs.unsqueeze(0), share)[0],
                routing_map.chunk(share.size)[share.rank])  # [T/t, h]
            out = gather_from_sequence_parallel_region(mine.unsqueeze(0), share,
                                                       reduce_grads=False)[0]  # [T, h]
        if shared is not None:
            out = out + shared
        return out.view(s, b, h).transpose(0, 1)  # [b, s, h]
