"""``--ckpt-format torch_dist`` on save: the run's checkpoints are Megatron-LM torch_dist
directories (read back by the Megatron-LM reader), and a run resumed from one continues with the
losses of an uninterrupted run."""

from __future__ import annotations

from megatron_h2.checkpointing.checkpoint_io import STAGING_DIR
from megatron_h2.checkpointing.megatron_read import detect_format, read_megatron
from tests.helpers.tiny_runs import run


def losses(rows: list[dict]) -> dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in rows if "lm_loss" in r}


def test_save_torch_dist_and_resume(corpus, tmp_path):
    common = ["--global-batch-size", "4", "--lr-decay-iters", "20", "--lr-warmup-iters", "2"]
    whole = losses(run(corpus, tmp_path / "a", *common, "--train-iters", "6"))
    save = tmp_path / "ckpt"
    run(corpus, tmp_path / "b", *common, "--train-iters", "6", "--exit-interval", "3",
        "--save", str(save), "--save-interval", "3", "--ckpt-format", "torch_dist")
    ckpt_dir = save / "iter_0000003"
    assert detect_format(ckpt_dir) == "torch_dist" and not (save / STAGING_DIR).exists()
    state = read_megatron(ckpt_dir)
    assert (state.iteration, state.consumed_samples) == (3, 12)
    assert state.optimizer and state.scheduler["num_steps"] == 12
    resumed = losses(run(corpus, tmp_path / "c", *common, "--train-iters", "6",
                         "--load", str(save)))
    assert sorted(resumed) == [4, 5, 6]
    for it, value in resumed.items():
        assert abs(value - whole[it]) <= 1e-6 * abs(whole[it]), (it, value, whole[it])
