"""HeteroPP: stages on different chip types with their own TP and layer counts, joined by the
cross-vendor bridge; compared with one process (real torchrun launches, gloo, CPU).

The model is a GPT-3-style command line (Megatron's default architecture), so the word
embedding on the first chip type and its tied copy on the last are summed across the chip types
every step, also between stages of different TP degrees."""

import json
from pathlib import Path

import pytest
import torch.distributed as dist
import yaml

from megatron_h2.training.main import main
from tests.helpers.dist_utils import losses, torchrun  # noqa: E402

MODEL = ["--num-layers", "6", "--hidden-size", "64", "--num-attention-heads", "4",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--seq-length", "32",
         "--max-position-embeddings", "32", "--lr", "3e-3", "--lr-warmup-iters", "2",
         "--seed", "11", "--train-iters", "10", "--log-interval", "1", "--eval-interval",
         "1000", "--eval-iters", "0", "--tokenizer-type", "NullTokenizer", "--vocab-size",
         "256", "--split", "90,10,0"]


def write_plan(path: Path, stages: list[dict], dp: int = 1, chips: dict | None = None,
               micro: int = 2, global_batch: int = 8) -> str:
    plan = {"data_parallel_size": dp, "micro_batch_size": micro,
            "global_batch_size": global_batch,
            "chips": chips or {"fast": {"device": "cpu"}, "slow": {"device": "cpu"}},
            "stages": stages}
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return str(path)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> dict[int, float]:
    out = tmp_path_factory.mktemp("ref") / "log.jsonl"
    assert main([*MODEL, "--data-path", corpus, "--micro-batch-size", "2",
                 "--global-batch-size", "8", "--log-jsonl", str(out)]) == 0
    return losses(out)


def close(got: dict[int, float], want: dict[int, float], rel: float) -> None:
    assert sorted(got) == sorted(want)
    for it, value in want.items():
        assert abs(got[it] - value) <= rel * abs(value), (it, got[it], value)


THREE_STAGES = [{"chip": "fast", "tensor_parallel_size": 2, "num_layers": 2},
                {"chip": "slow", "tensor_parallel_size": 1, "num_layers": 1,
                 "recompute": "full"},
                {"chip": "fast", "tensor_parallel_size": 2, "num_layers": 3,
                 "recompute": "selective"}]


@pytest.mark.e2e
def test_three_stages_tp_2_1_2_through_the_bridge(corpus, reference, tmp_path):
    plan = write_plan(tmp_path / "plan.yaml", THREE_STAGES)
    out, trace = tmp_path / "log.jsonl", tmp_path / "trace.json"
    proc = torchrun(5, [*MODEL, "--data-path", corpus, "--hetero-plan", plan, "--force-bridge",
                        "--log-jsonl", str(out), "--timeline-trace", str(trace)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    close(losses(out), reference, 1e-5)
    assert "bridge" in proc.stdout and "bubble" in proc.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    ranks = {e["tid"] for e in events if e.get("ph") == "X"}
    assert ranks == set(range(5))
    kinds = {e["cat"] for e in events if e.get("ph") == "X"}
    assert {"forward", "backward", "send_forward", "recv_forward"} <= kinds


@pytest.mark.e2e
def test_two_stages_tp_2_1_with_dp_2(corpus, reference, tmp_path):
    """Two chip types (emulated: every boundary through the bridge) with TP 2 and 1: each rank
    of the TP-1 stage sums the tied embedding with both TP-2 ranks of its replica."""
    plan = write_plan(tmp_path / "plan.yaml",
                      [{"chip": "fast", "tensor_parallel_size": 2, "num_layers": 4},
                       {"chip": "slow", "tensor_parallel_size": 1, "num_layers": 2}], dp=2)
    out = tmp_path / "log.jsonl"
    proc = torchrun(6, [*MODEL, "--data-path", corpus, "--hetero-plan", plan, "--force-bridge",
                        "--log-jsonl", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    close(losses(out), reference, 1e-5)


@pytest.mark.e2e
def test_bf16_bridge_and_emulated_slowdown(corpus, reference, tmp_path):
    chips = {"fast": {"device": "cpu"}, "slow": {"device": "cpu", "emulate_slowdown": 2.0}}
    plan = write_plan(tmp_path / "plan.yaml",
                      [{"chip": "fast", "tensor_parallel_size": 1, "num_layers": 4},
                       {"chip": "slow", "tensor_parallel_size": 1, "num_layers": 2}],
                      chips=chips)
    out = tmp_path / "log.jsonl"
    proc = torchrun(2, [*MODEL, "--data-path", corpus, "--hetero-plan", plan, "--force-bridge",
                        "--bridge-dtype", "bf16", "--log-jsonl", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    close(losses(out), reference, 1e-2)
    assert "emulating a chip 2x slower" in proc.stdout


GOOD = [{"chip": "fast", "tensor_parallel_size": 2, "num_layers": 4},
        {"chip": "slow", "tensor_parallel_size": 1, "num_layers": 2}]


@pytest.mark.parametrize("case, world, fragment", [
    ("layers", 3, "hold 4+1 = 5 layers but the model has 6"),
    ("world", 4, "needs world size 3"),
    ("heads", 4, "does not divide the 4 attention heads"),
    ("groups", 5, "does not divide the 2 query groups"),
    ("unknown_chip", 3, "unknown chip 'fats'"),
    ("missing_key", 3, "num_layers"),
    ("misspelt_key", 3, "tensor_paralel_size"),
    ("zero_tp", 3, "tensor_parallel_size"),
    ("negative_layers", 3, "num_layers"),
    ("empty_middle", 4, "stage 1 has no layer"),
    ("unknown_device", 3, "unknown device 'tpu9'"),
    ("flag_conflict", 3, "--tensor-model-parallel-size conflicts with --hetero-plan"),
])
def test_bad_plan_is_one_line_before_any_process_group(case, world, fragment, corpus, tmp_path,
                                                       monkeypatch, capsys):
    stages = [dict(s) for s in GOOD]
    chips, extra = None, []
    if case == "layers":
        stages[1]["num_layers"] = 1
    elif case == "heads":
        stages[1]["tensor_parallel_size"] = 3
    elif case == "groups":
        stages[0]["tensor_parallel_size"] = 4
        extra = ["--group-query-attention", "--num-query-groups", "2"]
    elif case == "unknown_chip":
        stages[0]["chip"] = "fats"
    elif case == "missing_key":
        del stages[0]["num_layers"]
    elif case == "misspelt_key":
        stages[0]["tensor_paralel_size"] = stages[0].pop("tensor_parallel_size")
    elif case == "zero_tp":
        stages[0]["tensor_parallel_size"] = 0
    elif case == "negative_layers":
        stages[1]["num_layers"] = -2
    elif case == "empty_middle":
        stages = [stages[0], {"chip": "slow", "tensor_parallel_size": 1, "num_layers": 0},
                  stages[1]]
    elif case == "unknown_device":
        chips = {"fast": {"device": "cpu"}, "slow": {"device": "tpu9"}}
    elif case == "flag_conflict":
        extra = ["--tensor-model-parallel-size", "2"]
    plan = write_plan(tmp_path / "plan.yaml", stages, chips=chips)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    assert main([*MODEL, "--data-path", corpus, "--hetero-plan", plan, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and fragment in err, err
    assert not dist.is_initialized()


def test_unavailable_chip_is_reported_by_its_own_rank(corpus, tmp_path, monkeypatch, capsys):
    chips = {"fast": {"device": "cpu"}, "slow": {"device": "cuda"}}
    plan = write_plan(tmp_path / "plan.yaml", GOOD, chips=chips)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")  # the stage on chip 'slow'
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main([*MODEL, "--data-path", corpus, "--hetero-plan", plan]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: [rank 2] stage 1 (chip 'slow'): --device cuda is not available on "
                   f"this machine (torch {torch.__version__}); pick another device or install "
                   "its torch backend")
    assert not dist.is_initialized()
