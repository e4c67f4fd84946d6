"""Continuing a Megatron-LM mixture-of-experts run (generate_moe.py's fixture, saved by
Megatron-Core at EP 2 with Adam's state) for 5 iterations in megatron_h2: the iteration and
consumed samples go on from the checkpoint's, both formats give the same losses, two pipeline
stages through the bridge give the one-process losses, and the optimizer state matters."""

from __future__ import annotations

import pytest

from megatron_h2.training.main import main
from tests.e2e.test_megatron_continue import close, corpus, model_flags, records  # noqa: F401
from tests.helpers.dist_utils import losses
from tests.helpers.fork_run import fork_run
from tests.helpers.paths import ROOT
from tests.unit.pipeline.test_hetero_pp import write_plan

FIXTURES = ROOT / "tests" / "fixtures" / "megatron"
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "8",
       "--moe-shared-expert-intermediate-size", "16", "--moe-router-load-balancing-type", "none",
       "--moe-token-dispatcher-type", "allgather"]


def test_continue_a_moe_run_saved_at_ep2(corpus, tmp_path):  # noqa: F811
    flags = [*model_flags("llama", corpus, tmp_path), *MOE, "--micro-batch-size", "2",
             "--global-batch-size", "4"]
    runs = {}
    for fmt in ("torch", "torch_dist"):
        log = tmp_path / f"{fmt}.jsonl"
        assert main([*flags, "--load", str(FIXTURES / "moe_ep2" / fmt),
                     "--log-jsonl", str(log)]) == 0
        runs[fmt] = losses(log)
    rows = records(tmp_path / "torch.jsonl")
    assert [r["iteration"] for r in rows] == [3, 4, 5, 6, 7]
    assert [r["consumed_samples"] for r in rows] == [12, 16, 20, 24, 28]
    close(runs["torch_dist"], runs["torch"], 1e-6)
    plan = write_plan(tmp_path / "plan.yaml",
                      [{"chip": "fast", "tensor_parallel_size": 1, "num_layers": 1},
                       {"chip": "slow", "tensor_parallel_size": 1, "num_layers": 1}],
                      micro=2, global_batch=4)
    other = tmp_path / "other.jsonl"
    proc = fork_run(2, [*model_flags("llama", corpus, tmp_path), *MOE, "--load",
                        str(FIXTURES / "moe_ep2" / "torch_dist"), "--hetero-plan", plan,
                        "--force-bridge", "--log-jsonl", str(other)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    close(losses(other), runs["torch"], 1e-5)
    assert [r["consumed_samples"] for r in records(other)] == [12, 16, 20, 24, 28]
    fresh = tmp_path / "fresh.jsonl"
    assert main([*flags, "--load", str(FIXTURES / "moe_ep2" / "torch"), "--no-load-optim",
                 "--log-jsonl", str(fresh)]) == 0
    assert losses(fresh)[7] != pytest.approx(runs["torch"][7], rel=1e-4)
