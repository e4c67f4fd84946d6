"""megatron_h2's AdamW: torch.optim.AdamW's numbers without torch.optim.Optimizer, whose
construction imports torch._dynamo in every training process."""

import subprocess
import sys

import pytest
import torch

from megatron_h2.optimizer.adamw import AdamW
from tests.helpers.paths import ROOT
from tests.helpers.tiny_runs import MODEL


def _groups(params: list[torch.nn.Parameter]) -> list[dict]:
    return [{"params": params[:2], "weight_decay": 0.1},
            {"params": params[2:], "weight_decay": 0.0, "lr": 0.5}]


@pytest.mark.parametrize("kernel", [{"foreach": True}, {"foreach": False}, {"fused": True}])
def test_steps_and_state_equal_torch_adamw(kernel):
    """Bitwise the same parameters and state as torch.optim.AdamW over several steps, with
    groups of their own rate and decay, and a parameter without a gradient at one step."""
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(*shape)) for shape in ((5, 3), (7,), (4, 2), (3,))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    hyper = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, **kernel}
    opt, ref = AdamW(_groups(ours), **hyper), torch.optim.AdamW(_groups(theirs), **hyper)
    for step in range(4):
        for mine, other in zip(ours, theirs):
            grad = torch.randn_like(mine)
            mine.grad, other.grad = grad.clone(), grad.clone()
        ours[1].grad = theirs[1].grad = None if step == 1 else ours[1].grad
        opt.step()
        ref.step()
        for mine, other in zip(ours, theirs):
            assert torch.equal(mine, other)
            assert opt.state[mine].keys() == ref.state[other].keys()
            for key, value in ref.state[other].items():
                assert torch.equal(opt.state[mine][key], value), key
                assert opt.state[mine][key].device == value.device
    assert [g["lr"] for g in opt.param_groups] == [3e-3, 0.5]
    opt.zero_grad()
    assert all(p.grad is None for p in ours)


def test_training_imports_neither_dynamo_nor_distributed_checkpoint(corpus, tmp_path):
    """A training process (two iterations and a save) in a fresh interpreter never imports
    torch._dynamo (torch.optim.Optimizer's constructor would) nor torch.distributed.checkpoint
    (needed only for Megatron's torch_dist format): about 3 s of CPU time per process."""
    code = ("import sys\n"
            "from megatron_h2.training.main import main\n"
            "assert main(sys.argv[1:]) == 0\n"
            "print(sorted(m for m in ('torch._dynamo', 'torch.distributed.checkpoint', 'sympy')"
            " if m in sys.modules))\n")
    flags = [*MODEL, "--data-path", corpus, "--data-cache-path", str(tmp_path / "cache"),
             "--train-iters", "2", "--global-batch-size", "2", "--save", str(tmp_path / "ckpt"),
             "--save-interval", "2"]
    proc = subprocess.run([sys.executable, "-c", code, *flags], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "ckpt" / "iter_0000002").is_dir()
    assert proc.stdout.splitlines()[-1] == "[]"
