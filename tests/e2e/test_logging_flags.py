"""Megatron's logging flags put what they say into the log line, the JSON lines, TensorBoard and
Weights & Biases; --profile writes a torch.profiler trace of the chosen steps."""

import gzip
import json
import logging
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_h2.checkpointing import load_checkpoint
from megatron_h2.training.main import main
from tests.helpers.paths import ROOT
from tests.helpers.tiny_runs import flags

SHORT = ("--train-iters", "4", "--lr-warmup-iters", "1", "--log-interval", "2",
         "--eval-interval", "2", "--eval-iters", "1", "--max-position-embeddings", "64")


def scalars(folder: Path) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` of the TensorBoard event files in ``folder``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.e2e
def test_logging_flags_reach_the_line_jsonl_and_tensorboard(corpus, tmp_path, capsys):
    tb = tmp_path / "tb"
    assert main(flags(corpus, tmp_path, *SHORT, "--save", str(tmp_path / "ckpt"),
                      "--tensorboard-dir", str(tb), "--log-throughput", "--log-params-norm",
                      "--log-num-zeros-in-grad", "--log-timers-to-tensorboard",
                      "--log-memory-to-tensorboard", "--log-validation-ppl-to-tensorboard",
                      "--timing-log-level", "2", "--timing-log-option", "all")) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "iteration        4/" in x)
    for part in ("throughput per GPU (TFLOP/s/GPU): ", "num zeros: ", "params norm: "):
        assert part in line
    assert "times across ranks (ms):" in out
    for name in ("forward-backward", "forward-compute", "backward-compute", "all-grads-sync",
                 "optimizer"):
        assert f"    {name} ." in out, name
    last = rows(tmp_path / "log.jsonl")[-1]
    # the norm of the parameters that were saved at iteration 4 (the tied embedding once)
    saved = load_checkpoint(tmp_path / "ckpt", 4).model
    norm = math.sqrt(sum(float(t.double().square().sum()) for t in saved.values()))
    assert last["params_norm"] == pytest.approx(norm, rel=1e-6)
    # the 32 rows of the position table past --seq-length 32 never get a gradient
    assert 32 * 64 <= last["num_zeros"] < sum(t.numel() for t in saved.values())
    assert last["throughput_per_gpu_tflops"] == pytest.approx(last["tflops"])  # one device
    tags = scalars(tb)
    assert set(tags["train/lm_loss"]) == {1, 2, 3, 4}  # --tensorboard-log-interval 1
    for tag in ("throughput", "params-norm", "iteration-time", "forward-backward-time",
                "backward-compute-time", "optimizer-time", "mem-rss-bytes",
                "mem-max-rss-bytes", "train/num_zeros"):
        assert tag in tags, tag
    assert tags["params-norm"][4] == pytest.approx(norm, rel=1e-6)
    val = {r["iteration"]: r["val_loss"] for r in rows(tmp_path / "log.jsonl") if "val_loss" in r}
    assert tags["validation/lm_loss_ppl"] == pytest.approx({it: math.exp(v)
                                                            for it, v in val.items()}, rel=1e-5)
    assert tags["mem-max-rss-bytes"][4] > 10 * 2**20


@pytest.mark.e2e
def test_defaults_level_interval_and_profile(corpus, tmp_path, capsys):
    tb = tmp_path / "tb"
    root = logging.getLogger()
    before = root.level
    try:
        assert main(flags(corpus, tmp_path, *SHORT, "--tensorboard-dir", str(tb),
                          "--tensorboard-log-interval", "2", "--logging-level", "30",
                          "--profile", "--profile-step-start", "1",
                          "--profile-step-end", "3")) == 0
    finally:
        root.setLevel(before)
    out = capsys.readouterr().out
    assert "iteration        4/" in out and "validation loss at iteration 4" in out
    assert "training finished" not in out and "model: " not in out  # info messages hidden
    for absent in ("throughput per GPU", "num zeros", "params norm", "time across ranks"):
        assert absent not in out
    tags = scalars(tb)
    assert set(tags["train/lm_loss"]) == {2, 4}
    assert not {"throughput", "params-norm", "iteration-time", "mem-rss-bytes",
                "validation/lm_loss_ppl"} & set(tags)
    trace = json.loads(gzip.decompress((tmp_path / "torch_profile" / "rank-0.json.gz")
                                       .read_bytes()))
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {n for n in names if str(n).startswith("iteration ")} == {"iteration 2",
                                                                     "iteration 3"}
    assert any("aten::" in str(n) for n in names)  # the steps' operators are in it


def wandb_history(run_file: Path) -> list[dict]:
    """The history rows of an offline run file (LevelDB-log records of wandb protobufs)."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw, block, pos, buf, out = run_file.read_bytes(), 32768, 7, b"", []
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        pos += 7
        if length == 0 and kind == 0:
            pos += left - 7
            continue
        buf += raw[pos:pos + length]
        pos += length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            if record.WhichOneof("record_type") == "history":
                out.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    return out


@pytest.mark.e2e
def test_wandb_offline_run_holds_the_logged_values(corpus, tmp_path):
    pytest.importorskip("wandb")
    env = dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(ROOT / "pretrain_gpt.py"),
           *flags(corpus, tmp_path, *SHORT, "--log-interval", "1", "--wandb-project", "proj",
                  "--wandb-exp-name", "tiny", "--wandb-save-dir", str(tmp_path / "wb"))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [run_file] = (tmp_path / "wb").glob("wandb/offline-run-*/run-*.wandb")
    history = wandb_history(run_file)
    losses = {r["_step"]: r["train/lm_loss"] for r in history if "train/lm_loss" in r}
    logged = {r["iteration"]: r["lm_loss"] for r in rows(tmp_path / "log.jsonl")}
    assert losses == pytest.approx(logged, rel=1e-6) and set(losses) == {1, 2, 3, 4}
    assert any("validation/lm_loss" in r for r in history)
