"""Interleaved (virtual-stage) 1F1B and zero-bubble schedules: bad virtual layouts are one line
before any process group. (The schedules in real torchrun launches against one process, with
MODEL, BATCH, HETERO_STAGES and write_plan from here: tests/e2e/test_virtual_pipeline.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist
import yaml

from megatron_h2.training.main import main

# 8 layers: 2 chunks x 2 stages, 2 chunks x 3 stages (uneven) and 4 stages all divide them;
# 12 samples of micro-batch 2 = 6 micro-batches, a multiple of 2 and 3 (interleaved needs it)
MODEL = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
         "--hidden-dropout", "0", "--attention-dropout", "0",
         "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "32",
         "--max-position-embeddings", "32", "--lr", "3e-3", "--lr-warmup-iters", "2",
         "--seed", "11", "--train-iters", "10", "--log-interval", "1", "--eval-interval",
         "1000", "--eval-iters", "0", "--tokenizer-type", "NullTokenizer", "--vocab-size",
         "256", "--split", "90,10,0"]
BATCH = ["--micro-batch-size", "2", "--global-batch-size", "12"]
HETERO_STAGES = [{"chip": "fast", "tensor_parallel_size": 2, "num_layers": [2, 1]},
                 {"chip": "slow", "tensor_parallel_size": 1, "num_layers": [1, 1]},
                 {"chip": "fast", "tensor_parallel_size": 2, "num_layers": [1, 2],
                  "recompute": "selective"}]


def write_plan(path: Path, stages: list[dict], global_batch: int = 12, **extra) -> str:
    plan = {"data_parallel_size": 1, "micro_batch_size": 2, "global_batch_size": global_batch,
            "chips": {"fast": {"device": "cpu"}, "slow": {"device": "cpu"}}, "stages": stages,
            **extra}
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return str(path)


def _plan_case(tmp_path: Path, case: str) -> tuple[list[str], int]:
    if case == "hetero_micro_batches":  # 3 stages, V = 2, 4 micro-batches
        return ["--hetero-plan", write_plan(tmp_path / "p.yaml", HETERO_STAGES, 8)], 5
    plan = write_plan(tmp_path / "p.yaml", HETERO_STAGES)
    flag = {"hetero_schedule": ["--pipeline-schedule", "zero-bubble"],
            "hetero_v_flag": ["--virtual-pipeline-model-parallel-size", "2"]}[case]
    return ["--hetero-plan", plan, *flag], 5


@pytest.mark.parametrize("world, flags, fragment", [
    (4, ["--pipeline-model-parallel-size", "4", "--virtual-pipeline-model-parallel-size", "2",
         "--num-layers", "8"], "(global batch / (micro-batch x DP) = 6) to be a multiple of the "
                               "pipeline size 4"),
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-layer-split", "3,1/2,1"],
     "--pipeline-layer-split 3,1/2,1 adds up to 7 layers but --num-layers is 8"),
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-layer-split", "3,1/4"],
     "has 1 counts in chunk 1 but --pipeline-model-parallel-size is 2"),
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-layer-split", "3,x/2,2"],
     "--pipeline-layer-split expects layer counts per stage separated by ','"),
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-layer-split", "2,2/0,4"],
     "chunk 1 of stage 0 has no layer"),
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-layer-split", "2,2/2,2",
         "--virtual-pipeline-model-parallel-size", "3"], "gives 2 model chunks but"),
    (2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
     "the 4 layers of each pipeline stage are not divisible by "
     "--num-layers-per-virtual-pipeline-stage 3"),
    (2, ["--pipeline-model-parallel-size", "2", "--num-layers", "7",
         "--num-layers-per-virtual-pipeline-stage", "1"],
     "needs --num-layers 7 divisible by --pipeline-model-parallel-size 2"),
    (2, ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "3"],
     "stage 0 has 4 layers, which do not split into --virtual-pipeline-model-parallel-size 3"),
    (2, ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
         "--num-layers-per-virtual-pipeline-stage", "2"], "give either"),
    (1, ["--virtual-pipeline-model-parallel-size", "2"], "need at least 2 pipeline stages"),
    (2, ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
         "--pipeline-schedule", "1f1b"], "the 1f1b schedule runs one model chunk per stage"),
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "interleaved"],
     "the interleaved schedule needs virtual pipeline stages"),
    (5, "hetero_micro_batches", "(global batch / (micro-batch x DP) = 4) to be a multiple of "
                                "the pipeline size 3"),
    (5, "hetero_schedule", "--pipeline-schedule zero-bubble differs from the plan's schedule "
                           "interleaved"),
    (5, "hetero_v_flag", "--virtual-pipeline-model-parallel-size conflicts with --hetero-plan"),
])
def test_bad_virtual_layout_is_one_line_before_any_process_group(world, flags, fragment, corpus,
                                                                 tmp_path, monkeypatch, capsys):
    if isinstance(flags, str):
        flags, world = _plan_case(tmp_path, flags)
        args = [*MODEL, *flags]
    else:
        args = [*MODEL, *BATCH, *flags]
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    assert main([*args, "--data-path", corpus]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and fragment in err, err
    assert not dist.is_initialized()
