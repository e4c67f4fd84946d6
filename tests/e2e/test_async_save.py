"""--async-save: training goes on while a checkpoint is written in the background, the result is
the checkpoint a synchronous save writes, and nothing is committed before every write is done."""

import json
import threading
from pathlib import Path

import pytest
import torch

import megatron_h2.checkpointing.async_save as async_save
from megatron_h2.checkpointing import load_checkpoint
from megatron_h2.checkpointing.format import LATEST_FILE, METADATA_FILE
from megatron_h2.checkpointing.integrity import MANIFEST_FILE
from megatron_h2.training.main import main
from megatron_h2.training.step import StepRunner
from tests.helpers.fork_run import fork_run
from tests.helpers.tiny_runs import flags, records

SAVES = ("--train-iters", "6", "--save-interval", "2", "--eval-iters", "0")


def _manifest(ckpt: Path, it: int) -> dict:
    """Size and SHA-256 of every part (metadata.json names the run's own config)."""
    files = json.loads((ckpt / f"iter_{it:07d}" / MANIFEST_FILE).read_text())["files"]
    return {name: entry for name, entry in files.items() if name != METADATA_FILE}


def _metadata(ckpt: Path, it: int) -> dict:
    meta = json.loads((ckpt / f"iter_{it:07d}" / METADATA_FILE).read_text())
    del meta["config"]["training"]["async_save"], meta["config"]["training"]["save"]
    return meta


@pytest.mark.e2e
def test_training_proceeds_during_the_write_and_the_checkpoint_equals_a_sync_save(
        corpus, tmp_path, monkeypatch, capsys):
    trained_past = threading.Event()  # set when iteration 4 has started
    seen: dict = {}
    real_step, real_write = StepRunner.train_step, async_save.write_part

    def step(self, dataset, start, iteration, *args, **kwargs):
        if iteration == 4:
            trained_past.set()
        return real_step(self, dataset, start, iteration, *args, **kwargs)

    def slow_write(tmp_dir, kind, part, tensors):
        if "iteration" not in seen:  # hold the first background write until training moved on
            seen["iteration"] = tmp_dir.name
            seen["proceeded"] = trained_past.wait(timeout=60)
            seen["committed_early"] = (tmp_dir.parent / "iter_0000002").exists() or \
                (tmp_dir.parent / LATEST_FILE).exists()
        return real_write(tmp_dir, kind, part, tensors)

    monkeypatch.setattr(StepRunner, "train_step", step)
    monkeypatch.setattr(async_save, "write_part", slow_write)
    background, sync = tmp_path / "async", tmp_path / "sync"
    assert main(flags(corpus, tmp_path, *SAVES, "--async-save", "--save", str(background))) == 0
    out = capsys.readouterr().out
    assert seen == {"iteration": ".iter_0000002.incomplete", "proceeded": True,
                    "committed_early": False}
    assert "saving checkpoint at iteration 2 in the background" in out
    assert "saved checkpoint at iteration 2 to" in out and "written in the background" in out
    monkeypatch.setattr(async_save, "write_part", real_write)
    assert main(flags(corpus, tmp_path, *SAVES, "--save", str(sync))) == 0
    for it in (2, 4, 6):  # byte-identical parts (same checksums), the same metadata
        assert _manifest(background, it) == _manifest(sync, it)
        assert _metadata(background, it) == _metadata(sync, it)
    assert (background / LATEST_FILE).read_text().strip() == "6"


@pytest.mark.e2e
def test_async_save_under_pipeline_parallelism_commits_complete_checkpoints(corpus, tmp_path):
    ckpt, sync = tmp_path / "async", tmp_path / "sync"
    proc = fork_run(2, [*flags(corpus, tmp_path, *SAVES, "--async-save", "--save", str(ckpt),
                               "--pipeline-model-parallel-size", "2")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert main(flags(corpus, tmp_path, *SAVES, "--save", str(sync))) == 0
    for it in (2, 4, 6):
        got, want = load_checkpoint(ckpt, it), load_checkpoint(sync, it)  # checksums verified
        assert got.model.keys() == want.model.keys()
        assert {p for p in _manifest(ckpt, it)} == {"model_00000.safetensors",
                                                      "model_00001.safetensors",
                                                      "optim_00000.safetensors",
                                                      "optim_00001.safetensors"}
        for name, tensor in want.model.items():
            torch.testing.assert_close(got.model[name], tensor, rtol=1e-4, atol=1e-5)


FP16 = ("--fp16", "--initial-loss-scale", "32768", "--loss-scale-window", "2", "--hysteresis",
        "1", "--log-interval", "1", "--eval-iters", "0", "--train-iters", "8",
        "--save-interval", "4")


@pytest.mark.e2e
def test_async_save_of_fp16_main_weights_and_loss_scaler_resumes_in_one_process(corpus,
                                                                                tmp_path):
    """--fp16 with ZeRO over DP 2 and a dynamic loss scale that moves during the run: the
    background save stores what a synchronous save stores (the fp32 main weights gathered from
    the master shards, not the fp16-rounded model, and the scaler's state as of the saved
    iteration although the commit comes later), and one process resumed from it continues the
    two-process run (losses and loss scales)."""
    background, sync, resumed = tmp_path / "async", tmp_path / "sync", tmp_path / "resumed"
    for run, extra in ((background, ["--async-save"]), (sync, [])):
        proc = fork_run(2, flags(corpus, run, *FP16, "--use-distributed-optimizer", *extra,
                                 "--save", str(run / "ckpt")))
        assert proc.returncode == 0, proc.stderr[-3000:]
    for it in (4, 8):  # byte-identical parts, the same metadata (scaler state included)
        assert _manifest(background / "ckpt", it) == _manifest(sync / "ckpt", it)
        got, want = (_metadata(run / "ckpt", it) for run in (background, sync))
        del got["config"], want["config"]  # the runs' own paths
        assert got == want and "grad_scaler" in got
    saved = load_checkpoint(background / "ckpt", 4)
    scales = records(background, "loss_scale")
    assert len(set(scales.values())) > 2  # the scale really moved
    assert saved.metadata["grad_scaler"]["scale"] == scales[4]
    weights = torch.cat([t.reshape(-1) for t in saved.model.values()])
    assert weights.dtype == torch.float32 and not torch.equal(weights, weights.half().float())
    assert main(flags(corpus, resumed, *FP16, "--load", str(background / "ckpt"),
                      "--ckpt-step", "4")) == 0
    assert records(resumed, "loss_scale") == {k: v for k, v in scales.items() if k > 4}
    want = records(background)
    for it, loss in records(resumed).items():
        assert abs(loss - want[it]) <= 1e-3 * want[it], (it, loss, want[it])
