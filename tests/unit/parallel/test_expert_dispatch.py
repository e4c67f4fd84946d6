"""The expert-parallel dispatch's local parts: the chunk reordering between source-major rows
(as the all-to-all delivers them) and expert-major rows (as the local experts run), and the
single-rank path that runs the experts on the permuted rows as they are."""

from __future__ import annotations

import torch

from megatron_h2.parallel.expert_parallel import EPContext, _reorder, dispatch_to_experts


def test_reorder_groups_rows_by_local_expert_and_back():
    sizes = torch.tensor([[2, 0, 1], [1, 3, 0]])  # [source rank, local expert] row counts
    rows = torch.arange(7.0).unsqueeze(-1)  # source 0: e0 e0 e2 | source 1: e0 e1 e1 e1
    by_expert = _reorder(rows, sizes, True)
    assert by_expert.squeeze(-1).tolist() == [0, 1, 3, 4, 5, 6, 2]  # e0 (src 0, 1), e1, e2
    assert torch.equal(_reorder(by_expert, sizes, False), rows)


def test_one_rank_runs_the_experts_on_the_rows_as_they_are():
    seen = []

    def experts(rows, counts, probs):
        seen.append((rows, counts, probs))
        return rows * probs.unsqueeze(-1)

    rows, probs = torch.randn(5, 3), torch.rand(5)
    out = dispatch_to_experts(rows, probs, torch.tensor([2, 0, 3]), EPContext.single(), experts)
    assert torch.equal(out, rows * probs.unsqueeze(-1))
    assert seen[0][1] == [2, 0, 3]
