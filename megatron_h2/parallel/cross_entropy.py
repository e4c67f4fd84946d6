"""Cross entropy over vocabulary-parallel logits, without gathering the full vocabulary.

Each rank holds logits [b, s, V/tp] for the token ids [r V/tp, (r+1) V/tp). The loss of a token
is ``log(sum_v exp(z_v - m)) - (z_label - m)`` with ``m`` the max logit; the max, the sum of
exponentials and the label's logit are each reduced over the TP group (the latter two in one
collective). The backward is ``softmax - one_hot(label)`` on the local shard, computed from the
saved fp32 softmax. Everything is computed in fp32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_h2.parallel.mappings import TPContext

IGNORE_INDEX = -100  # as F.cross_entropy


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, tp: TPContext,
                ignore_index: int) -> torch.Tensor:
        ctx.in_dtype = logits.dtype
        logits = logits.float()  # [b, s, V/tp]
        vocab_per_rank = logits.shape[-1]
        logits_max = logits.amax(dim=-1)  # [b, s]
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=tp.group)
        shifted = logits - logits_max.unsqueeze(-1)  # [b, s, V/tp], all <= 0

        local_labels = labels - tp.rank * vocab_per_rank  # [b, s]
        outside = (local_labels < 0) | (local_labels >= vocab_per_rank)
        local_labels = local_labels.masked_fill(outside, 0)
        target = shifted.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1)  # [b, s]
        target = target.masked_fill(outside, 0.0)

        exp = shifted.exp_()  # [b, s, V/tp], reuses the buffer of `shifted`
        stats = torch.stack((exp.sum(dim=-1), target))  # [2, b, s]: sum-exp, label logit
        dist.all_reduce(stats, group=tp.group)
        sum_exp, target = stats.unbind(0)

        loss = torch.log(sum_exp) - target  # [b, s]
        ignored = labels == ignore_index
        loss = loss.masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))  # [b, s, V/tp]
        ctx.save_for_backward(softmax, local_labels, outside | ignored, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local_labels, no_target, ignored = ctx.saved_tensors
        # d loss / d z = softmax - one_hot(label), on the local shard only.
        grad = softmax.scatter_add(-1, local_labels.unsqueeze(-1),
                                   (~no_target).to(softmax.dtype).unsqueeze(-1).neg())
        scale = grad_loss.float().masked_fill(ignored, 0.0)  # [b, s]
        grad.mul_(scale.unsqueeze(-1))  # [b, s, V/tp]
        return grad.to(ctx.in_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, tp: TPContext,
                                 ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Per-token cross entropy [b, s] (fp32) of vocab-parallel ``logits`` [b, s, V/tp].

    ``labels`` [b, s] are global token ids; tokens labelled ``ignore_index`` get loss 0 and no
    gradient. With ``tp.size == 1`` this is exactly ``F.cross_entropy(logits.float(), labels,
    reduction="none")``.
    """
    if tp.size == 1:
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                               ignore_index=ignore_index, reduction="none").view_as(labels)
    return _VocabParallelCrossEntropy.apply(logits, labels, tp, ignore_index)
