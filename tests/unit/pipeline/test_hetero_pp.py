"""HeteroPP plans refused before any process group starts: each bad plan is one line, and a chip
this machine lacks is reported by the rank of its stage. (Stages on different chip types trained
through the bridge against one process: tests/e2e/test_hetero_pp.py, with MODEL and
write_plan from here.)"""

from pathlib import Path

import pytest
import torch.distributed as dist
import yaml

from megatron_h2.training.main import main

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
