"""A run is built once from the typed config and trained by the loop, without main([...])."""

from __future__ import annotations

from megatron_h2.training.arguments import config_from_args
from megatron_h2.training.build import Run, build_run
from megatron_h2.training.loop import train
from tests.helpers.dist_utils import losses, tiny_model_flags


def test_build_run_then_train_steps_as_main_does(corpus, tiny_reference, tmp_path):
    """Three steps (the first update under warm-up has learning rate 0, so the third loss is
    the first that an update moved) of the 10-iteration reference run, stopped by
    --exit-interval."""
    log = tmp_path / "log.jsonl"
    cfg, launch = config_from_args([*tiny_model_flags(), "--data-path", corpus,
                                    "--micro-batch-size", "2", "--global-batch-size", "8",
                                    "--exit-interval", "3", "--log-jsonl", str(log)])
    lines: list[str] = []
    run = build_run(cfg, launch, say=lines.append)
    try:
        assert isinstance(run, Run)
        assert run.iterations == 10 and run.progress.iteration == 0
        assert run.plan.pipeline_parallel_size == 1 and run.topo.world_size == 1
        assert run.runner.model is run.model and run.ckpt.model is run.model
        assert run.schedule.num_steps == 0
        progress = train(run)
    finally:
        run.close()
    assert progress.iteration == 3 and progress.consumed_samples == 24
    assert losses(log) == {i: tiny_reference[i] for i in (1, 2, 3)}  # main([...])'s losses
