"""Backward split in two for zero-bubble schedules: input gradient now (B), weight gradients
later (W).

The method is the one of ``torch.distributed.pipelining._backward`` (``stage_backward_input`` /
``stage_backward_weight``), written against our needs (gradients must reach the parameters
through their ``AccumulateGrad`` nodes, where the data-parallel buckets' hooks wait):

* **B** (:func:`backward_input`): walk the autograd graph of one micro-batch from the chunk's
  output. The nodes on paths from the output to the chunk's input form the *input path*; every
  parameter joins it at one or more nodes (e.g. the ``mm`` of a linear layer). Hooks on those
  join nodes keep the gradient flowing into them, then ``torch.autograd.grad`` computes the
  gradient of the input only (``retain_graph``). Autograd computes only what that needs: a
  linear layer's ``mm`` backward produces its input gradient, not its weight gradient.
* **W** (:func:`backward_weight`): per group of parameters that share join nodes, one
  ``torch.autograd.backward`` from those nodes, seeded with the kept gradients, with
  ``inputs=`` the group's parameters: only the weight-gradient work runs (the ``mm`` for the
  weight, transposes, accumulation), and it accumulates into ``param.grad`` through
  ``AccumulateGrad``, so gradient hooks fire as in a plain backward. A join node reached from
  another one of the same group is seeded only once (its hook replaces what flows in with the
  kept gradient).

B + W do the work of one backward (``tests/unit/pipeline/test_split_backward.py`` counts the FLOPs)
and give the same gradients. No collective runs in W for this model: the tensor-parallel ones lie
on the input path. Two cases are not split (:class:`PendingWeights` then carries a plain backward,
and B does nothing but remember its inputs): a chunk without an input gradient (the first virtual
stage, whose input is token ids), which is what torch does, and layers recomputed in full
(``torch.utils.checkpoint`` would recompute each layer once per weight group).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node


def _node(t: torch.Tensor) -> Node:
    """The autograd node of ``t``: its ``grad_fn``, or for a leaf its ``AccumulateGrad``."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]


def _consumers(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """Reverse edges of the graph below ``roots``: node -> the nodes that feed it a gradient."""
    users: dict[Node, list[Node]] = collections.defaultdict(list)
    seen, queue = set(roots), collections.deque(roots)
    while queue:
        node = queue.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            users[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return users


def _closure(start: Node, stop: set[Node], users: dict[Node, list[Node]]
             ) -> tuple[set[Node], list[Node]]:
    """Nodes reached from ``start`` towards the output, and the ones of ``stop`` met on the way
    (not crossed), in the order met."""
    reached, met, queue = {start}, {}, collections.deque([start])
    while queue:
        for user in users[queue.popleft()]:
            if user in reached:
                continue
            if user in stop:
                met[user] = None
                continue
            reached.add(user)
            queue.append(user)
    return reached, list(met)


@dataclass(eq=False)  # compared by identity: the fields hold tensors
class _Group:
    """Parameters whose gradients start from the same join nodes of the input path."""

    params: list[torch.Tensor]
    joins: list[Node]
    grads: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)


@dataclass
class PendingWeights:
    """What :func:`backward_weight` needs: the split groups, or a whole deferred backward."""

    groups: list[_Group] = field(default_factory=list)
    output: torch.Tensor | None = None  # whole backward deferred: output (or loss) ...
    output_grad: torch.Tensor | None = None  # ... and its gradient (None for a loss)


def _param_groups(output: torch.Tensor, inp: torch.Tensor,
                  params: Sequence[torch.Tensor]) -> list[_Group]:
    """Group ``params`` by the join nodes where their gradients leave the input path (groups
    that share a join node are merged)."""
    users = _consumers([_node(output)])
    path, _ = _closure(_node(inp), set(), users)
    groups: list[_Group] = []
    for param in params:
        node = _node(param)
        if node not in users:
            continue  # the parameter took no part in this micro-batch
        _, joins = _closure(node, path, users)
        group = _Group([param], joins)
        for other in [g for g in groups if set(g.joins) & set(joins)]:
            groups.remove(other)
            group.params = other.params + group.params
            group.joins = other.joins + [j for j in group.joins if j not in other.joins]
        groups.append(group)
    return groups


def backward_input(output: torch.Tensor, output_grad: torch.Tensor | None,
                   inp: torch.Tensor | None, params: Sequence[torch.Tensor],
                   split: bool = True) -> tuple[torch.Tensor | None, PendingWeights]:
    """B: the gradient of ``inp`` (the chunk's input, a leaf that requires grad) from
    ``output`` (the chunk's output with its gradient ``output_grad``, or the scalar loss with
    None). Returns it and what :func:`backward_weight` needs for ``params``.

    Without an input (first virtual stage) or with ``split=False`` nothing runs now: the whole
    backward is deferred to W (see the module docstring).
    """
    if inp is None or not split:
        return None, PendingWeights(output=output, output_grad=output_grad)
    groups = _param_groups(output, inp, params)
    handles = []
    for group in groups:
        for join in group.joins:
            handles.append(join.register_prehook(
                lambda grads, g=group, n=join: g.grads.__setitem__(n, grads)))
    try:
        grads = None if output_grad is None else [output_grad]
        (grad_in,) = torch.autograd.grad([output], [inp], grads, retain_graph=True,
                                         allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    if not output._is_view():
        output.detach_()  # the graph now lives only through the join nodes, until W
    return grad_in, PendingWeights(groups=groups)


def backward_weight(pending: PendingWeights) -> None:
    """W: accumulate the weight gradients that :func:`backward_input` deferred."""
    if pending.output is not None:
        grads = None if pending.output_grad is None else [pending.output_grad]
        torch.autograd.backward([pending.output], grads)
        pending.output = pending.output_grad = None
        return
    for group in pending.groups:
        edges, seeds, handles = [], [], []
        for join in group.joins:
            kept = group.grads.get(join)
            if kept is None:
                continue  # no gradient reached this join node
            for index, grad in enumerate(kept):
                if grad is not None:
                    edges.append(GradientEdge(join, index))
                    seeds.append(grad)
            if len(group.joins) > 1:  # reached from another join node: count the seed once
                handles.append(join.register_prehook(lambda _, k=kept: k))
        try:
            if edges:
                torch.autograd.backward(edges, seeds, inputs=group.params)
        finally:
            for handle in handles:
                handle.remove()
    pending.groups = []
