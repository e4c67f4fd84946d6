"""Mixture-of-experts training with multi-rank runs (gloo, CPU) against one process.

Two MoE command lines on the GPT of tests/unit/training/test_parallel_training.py: a Mixtral-
like one (softmax top-2, aux and z losses, shared experts, a dense first layer) and a
DeepSeek-V3-like one (sigmoid scores, auxiliary-loss-free expert bias, sequence aux loss,
capacity with token dropping by position). Data parallelism (replicated and ZeRO-1), tensor
parallelism (experts and shared experts split like the dense MLP, the router replicated) and
interleaved pipeline parallelism must reproduce the single-process losses of 10 iterations
within 1e-5 relative, the aux / z losses the log line reports and the tokens each expert
received; a checkpoint saved under DP 2 resumes in one process with the uninterrupted losses
(the expert bias travels with it).
"""

import json

import pytest
from safetensors import safe_open

from megatron_h2.training.main import main
from tests.helpers.dist_utils import losses
from tests.helpers.fork_run import fork_run
from tests.unit.training.test_parallel_training import MODEL

MIXTRAL_LIKE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
                "--moe-z-loss-coeff", "1e-3", "--moe-layer-freq", "([0]*1+[1]*3)",
                "--moe-ffn-hidden-size", "64", "--moe-shared-expert-intermediate-size", "32"]
DEEPSEEK_LIKE = ["--num-experts", "4", "--moe-router-topk", "2",
                 "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                 "--moe-router-bias-update-rate", "1e-2",
                 "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff",
                 "1e-3", "--moe-expert-capacity-factor", "1.0", "--moe-token-drop-policy",
                 "position", "--moe-router-topk-scaling-factor", "2.5"]
ARCHS = {"mixtral": MIXTRAL_LIKE, "deepseek": DEEPSEEK_LIKE}


def records(path) -> dict[int, dict]:
    rows = [json.loads(line) for line in open(path)]
    return {r["iteration"]: r for r in rows if "lm_loss" in r}


def assert_same_run(got: dict[int, dict], want: dict[int, dict], rel: float = 1e-5) -> None:
    assert sorted(got) == sorted(want)
    for it, ref in want.items():
        row = got[it]
        assert abs(row["lm_loss"] - ref["lm_loss"]) <= rel * abs(ref["lm_loss"]), (it, row, ref)
        for name, value in ref["moe_losses"].items():
            assert abs(row["moe_losses"][name] - value) <= rel * abs(value), (it, name)
        assert row["moe_tokens_per_expert"] == ref["moe_tokens_per_expert"], it


@pytest.fixture(scope="module")
def references(corpus, tmp_path_factory) -> dict[str, dict[int, dict]]:
    """``{arch: {iteration: log record}}`` of one process training each MoE command line."""
    return moe_references(corpus, tmp_path_factory)


def moe_references(corpus, tmp_path_factory) -> dict[str, dict[int, dict]]:
    """Run each of :data:`ARCHS` in one process; its log records by iteration."""
    out = {}
    for name, arch in ARCHS.items():
        log = tmp_path_factory.mktemp(f"ref_{name}") / "log.jsonl"
        assert main([*MODEL, *arch, "--data-path", corpus, "--log-jsonl", str(log)]) == 0
        out[name] = records(log)
    return out


def test_reference_runs_are_moe(references):
    for name, rows in references.items():
        assert rows[10]["lm_loss"] < rows[1]["lm_loss"], name  # it learns
        counts = rows[1]["moe_tokens_per_expert"]
        layers = ["1", "2", "3"] if name == "mixtral" else ["0", "1", "2", "3"]
        assert sorted(counts) == layers
        routed = 8 * 32 * 2  # the global batch's tokens x top-2
        if name == "mixtral":
            assert all(sum(c) == routed for c in counts.values())
            assert set(rows[1]["moe_losses"]) == {"load_balancing_loss", "z_loss"}
        else:  # capacity 1.0: at most 64 x 2 / 4 = 32 tokens per expert and micro-batch
            assert all(sum(c) < routed and max(c) <= 4 * 32 for c in counts.values())
            assert set(rows[1]["moe_losses"]) == {"seq_load_balancing_loss"}


LAYOUTS = {  # name: (processes, flags)
    "dp2": (2, []),
    "dp2_zero1": (2, ["--use-distributed-optimizer"]),
    "pp2_interleaved": (2, ["--pipeline-model-parallel-size", "2",
                            "--virtual-pipeline-model-parallel-size", "2"]),
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
}


@pytest.mark.e2e
@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(arch, layout, corpus, references, tmp_path):
    nproc, flags = LAYOUTS[layout]
    out = tmp_path / "log.jsonl"
    proc = fork_run(nproc, [*MODEL, *ARCHS[arch], "--data-path", corpus, "--log-jsonl",
                            str(out), *flags], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_run(records(out), references[arch])
    assert " load_balancing_loss: " in proc.stdout or arch != "mixtral"


@pytest.mark.e2e
def test_checkpoint_saved_under_dp2_resumes_in_one_process(corpus, references, tmp_path):
    arch = DEEPSEEK_LIKE
    ckpt = tmp_path / "ckpt"
    first = fork_run(2, [*MODEL, *arch, "--data-path", corpus, "--save", str(ckpt),
                         "--exit-interval", "5", "--log-jsonl", str(tmp_path / "a.jsonl")],
                     timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    with safe_open(str(ckpt / "iter_0000005" / "model_00000.safetensors"), "pt") as f:
        keys = set(f.keys())
        bias = f.get_tensor("decoder.layers.0.mlp.router.expert_bias")
    assert "decoder.layers.3.mlp.experts.local_experts.3.linear_fc2.weight" in keys
    assert bias.abs().sum() > 0  # five updates moved it
    assert main([*MODEL, *arch, "--data-path", corpus, "--load", str(ckpt),
                 "--log-jsonl", str(tmp_path / "b.jsonl")]) == 0
    want = {k: v["lm_loss"] for k, v in references["deepseek"].items()}
    got = losses(tmp_path / "b.jsonl")
    assert sorted(got) == [k for k in sorted(want) if k > 5]
    for it, value in got.items():
        assert abs(value - want[it]) <= 1e-5 * abs(want[it]), (it, value, want[it])


@pytest.mark.e2e
@pytest.mark.parametrize("arch", list(ARCHS))
def test_two_chip_types_through_the_bridge(arch, corpus, references, tmp_path):
    """A heterogeneous plan: the dense-or-MoE first layer on one chip type with DP 2, three MoE
    layers on the other with DP 1, every boundary through the bridge."""
    from tests.unit.pipeline.test_hetero_pp import write_plan

    plan = write_plan(tmp_path / "plan.yaml",
                      [{"chip": "fast", "tensor_parallel_size": 1, "num_layers": 1,
                        "data_parallel_size": 2},
                       {"chip": "slow", "tensor_parallel_size": 1, "num_layers": 3}])
    out = tmp_path / "log.jsonl"
    proc = fork_run(3, [*MODEL, *ARCHS[arch], "--data-path", corpus, "--hetero-plan", plan,
                        "--force-bridge", "--log-jsonl", str(out)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_run(records(out), references[arch])


@pytest.mark.e2e
def test_full_recompute_counts_each_token_once(corpus, references, tmp_path):
    """Recomputed MoE layers route again in the backward: the losses, the logged aux loss and
    the tokens per expert (and so the expert-bias update) are those of the plain run."""
    out = tmp_path / "log.jsonl"
    assert main([*MODEL, *DEEPSEEK_LIKE, "--data-path", corpus, "--log-jsonl", str(out),
                 "--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1"]) == 0
    assert_same_run(records(out), references["deepseek"])
