"""TP / PP / DP training with multi-rank runs (gloo, CPU) against one process.

Every layout must reproduce the single-process losses of the first 10 iterations within 1e-5
relative; checkpoints saved under one layout resume under others; a failing rank ends the job
instead of hanging it.

The model is a GPT-3-style command line (tests/unit/training/test_parallel_training.py's MODEL,
no architecture flags: Megatron's LayerNorm, 4h GeLU MLP with biases, learned positions,
embedding tied to the output layer, whose copies on the first and last pipeline stage have
their gradients summed); two layouts also run the LLaMA flags (SwiGLU blocks and grouped-query
heads split over TP, rotary positions, untied).
"""

import os
import subprocess
import sys

import pytest
from safetensors import safe_open

from megatron_h2.training.main import main
from tests.helpers.dist_utils import free_port, losses, torchrun
from tests.helpers.fork_run import fork_run
from tests.helpers.paths import ROOT
from tests.unit.training.test_parallel_training import MODEL

LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "128"]


def assert_close(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want)
    for it, value in want.items():
        assert abs(got[it] - value) <= 1e-5 * abs(value), (it, got[it], value)


def _reference(corpus, tmp_path_factory, *arch: str) -> dict[int, float]:
    out = tmp_path_factory.mktemp("ref") / "log.jsonl"
    assert main([*MODEL, *arch, "--data-path", corpus, "--log-jsonl", str(out)]) == 0
    return figures(out)


def figures(path) -> dict[int, tuple[float, float, int]]:
    """``{iteration: (lm loss, params norm, zeros in the gradient)}`` of a --log-jsonl file."""
    import json

    rows = [json.loads(line) for line in open(path)]
    return {r["iteration"]: (r["lm_loss"], r["params_norm"], r["num_zeros"]) for r in rows}


def assert_figures(got: dict, want: dict) -> None:
    """Losses and parameter norms within 1e-5; the zeros in the gradient (the GPT's 16 x 64
    position-table entries past --seq-length, LLaMA's embedding rows of tokens the batch lacks)
    counted once over TP, PP and DP, up to a few elements that round to zero differently under
    each layout."""
    assert_close({k: v[0] for k, v in got.items()}, {k: v[0] for k, v in want.items()})
    assert_close({k: v[1] for k, v in got.items()}, {k: v[1] for k, v in want.items()})
    for it, (_, _, zeros) in want.items():
        assert zeros >= 16 * 64 and abs(got[it][2] - zeros) <= 8, (it, got[it], zeros)


@pytest.fixture(scope="module")
def reference_figures(corpus, tmp_path_factory) -> dict[int, tuple]:
    return _reference(corpus, tmp_path_factory)


@pytest.fixture(scope="module")
def reference(reference_figures) -> dict[int, float]:
    return {k: v[0] for k, v in reference_figures.items()}


@pytest.fixture(scope="module")
def llama_reference(corpus, tmp_path_factory) -> dict[int, tuple]:
    return _reference(corpus, tmp_path_factory, *LLAMA)


LAYOUTS = {  # name: (processes, flags); (TP, PP, DP) in the name
    "tp2_pp1_dp1": (2, ["--tensor-model-parallel-size", "2"]),
    "tp1_pp2_dp1": (2, ["--pipeline-model-parallel-size", "2"]),
    "tp1_pp1_dp2": (2, []),
    "tp2_pp2_dp1": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                        "2", "--timing-log-level", "2"]),
    "tp1_pp2_dp2_overlap": (4, ["--pipeline-model-parallel-size", "2",
                                "--overlap-grad-reduce", "--use-distributed-optimizer",
                                "--overlap-param-gather"]),
    "tp2_pp1_dp2_zero_sp": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                "--use-distributed-optimizer"]),
    "pp2_split_3_1": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-layer-split",
                          "3,1"]),
    "llama_tp2_pp2_dp1": (4, [*LLAMA, "--tensor-model-parallel-size", "2",
                              "--pipeline-model-parallel-size", "2"]),
    "llama_tp2_pp1_dp2_zero_sp": (4, [*LLAMA, "--tensor-model-parallel-size", "2",
                                      "--sequence-parallel", "--use-distributed-optimizer"]),
}


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, corpus, request, tmp_path):
    nproc, flags = LAYOUTS[name]
    want = request.getfixturevalue("llama_reference" if name.startswith("llama")
                                   else "reference_figures")
    out = tmp_path / "log.jsonl"
    proc = fork_run(nproc, [*MODEL, "--data-path", corpus, "--log-jsonl", str(out), *flags])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_figures(figures(out), want)
    if "--timing-log-level" in flags:  # every rank's timers, pipeline waits included
        assert "(min, max) time across ranks (ms):" in proc.stdout
        assert "    pipeline-recv-wait ." in proc.stdout


@pytest.mark.e2e
def test_checkpoint_moves_between_layouts(corpus, reference, tmp_path):
    """Saved at (TP, PP, DP) = (2, 2, 1) after 5 iterations; resumed at (1, 1, 1) and at
    (1, 2, 2) with the distributed optimizer: both continue with the uninterrupted losses."""
    ckpt = tmp_path / "ckpt"
    first = fork_run(4, [*MODEL, "--data-path", corpus, "--tensor-model-parallel-size", "2",
                         "--pipeline-model-parallel-size", "2", "--save", str(ckpt),
                         "--exit-interval", "5", "--log-jsonl", str(tmp_path / "a.jsonl")])
    assert first.returncode == 0, first.stderr[-3000:]
    parts = sorted(p.name for p in (ckpt / "iter_0000005").iterdir())
    assert parts == ["manifest.json", "metadata.json", "model_00000.safetensors",
                     "model_00001.safetensors", "optim_00000.safetensors",
                     "optim_00001.safetensors"]
    keys = [set(safe_open(str(ckpt / "iter_0000005" / f"model_0000{i}.safetensors"),
                          "pt").keys()) for i in (0, 1)]
    tied = "embedding.word_embeddings.weight"  # stored once, by the first stage
    assert tied in keys[0] and tied not in keys[1] and "output_layer.weight" not in keys[1]
    assert main([*MODEL, "--data-path", corpus, "--load", str(ckpt),
                 "--log-jsonl", str(tmp_path / "b.jsonl")]) == 0
    third = fork_run(4, [*MODEL, "--data-path", corpus, "--pipeline-model-parallel-size", "2",
                         "--use-distributed-optimizer", "--load", str(ckpt),
                         "--log-jsonl", str(tmp_path / "c.jsonl")])
    assert third.returncode == 0, third.stderr[-3000:]
    later = {k: v for k, v in reference.items() if k > 5}
    assert_close(losses(tmp_path / "a.jsonl"), {k: v for k, v in reference.items() if k <= 5})
    assert_close(losses(tmp_path / "b.jsonl"), later)
    assert_close(losses(tmp_path / "c.jsonl"), later)


@pytest.mark.e2e
def test_failing_rank_ends_the_job_with_one_error(corpus, tmp_path):
    proc = torchrun(2, [*MODEL, "--data-path", corpus, "--pipeline-model-parallel-size", "2",
                        "--train-iters", "50"], env_extra={"MEGATRON_H2_INJECT_FAULT": "1:3"},
                    timeout=120)
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines()
            if line.startswith(("error:", "[rank"))]
    assert ours[0].startswith("error: [rank 1] RuntimeError: injected fault at iteration 3")
    assert sum(line.startswith("error:") for line in ours) == 1
    assert proc.stderr.count("injected fault at iteration 3") <= 3  # ours + torchrun's summary
    assert "iteration       50/" not in proc.stdout


@pytest.mark.e2e
def test_failing_store_host_ends_the_job_with_one_error(corpus):
    """Processes started directly, as srun does: rank 0 hosts the rendezvous store and fails."""
    port = str(free_port())
    cmd = [sys.executable, str(ROOT / "pretrain_gpt.py"), *MODEL, "--data-path", corpus,
           "--pipeline-model-parallel-size", "2", "--train-iters", "50"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=port, RANK=str(rank), LOCAL_RANK=str(rank),
                                       WORLD_SIZE="2", MEGATRON_H2_INJECT_FAULT="0:3"))
             for rank in range(2)]
    errors = [proc.communicate(timeout=120)[1] for proc in procs]
    assert [proc.returncode for proc in procs] == [1, 1]
    assert errors[0].startswith("error: [rank 0] RuntimeError: injected fault at iteration 3")
    stopping = "[rank 1] stopping: another rank failed or the connection was lost (RuntimeError)"
    assert stopping in errors[1].splitlines()
    assert "error" not in errors[1] and "frame #" not in errors[1], errors[1]


@pytest.mark.e2e
def test_slurm_script_launches_a_job(corpus, reference, tmp_path):
    """scripts/slurm_pretrain.sh under stand-in srun/scontrol (one node, two processes)."""
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")
    # srun: drop its own options, run the command once (one node)
    (shims / "srun").write_text('#!/bin/sh\nwhile [ "${1#--}" != "$1" ]; do shift; done\n'
                                'exec "$@"\n')
    for shim in shims.iterdir():
        shim.chmod(0o755)
    out = tmp_path / "log.jsonl"
    env = dict(os.environ, PATH=f"{shims}:{os.environ['PATH']}", SLURM_JOB_NODELIST="node1",
               SLURM_NNODES="1", SLURM_JOB_ID="7", SLURM_SUBMIT_DIR=str(ROOT),
               NPROC_PER_NODE="2", MASTER_PORT=str(free_port()), PYTHON=sys.executable,
               OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "slurm_pretrain.sh"), *MODEL,
                           "--exit-interval", "3",
                           "--data-path", corpus, "--pipeline-model-parallel-size", "2",
                           "--log-jsonl", str(out)], capture_output=True, text=True,
                          timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 node(s) x 2 processes" in proc.stdout
    got = losses(out)
    assert sorted(got) == [1, 2, 3]
    for it in got:
        assert abs(got[it] - reference[it]) <= 1e-5 * reference[it]
