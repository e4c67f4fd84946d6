"""The run: the command line (:mod:`.arguments`), the checks before any process group starts
(:mod:`.launch_checks`), building a run once (:mod:`.build`), the loop (:mod:`.loop`), one step
(:mod:`.step`), the batch schedule, the data source, the launch layout, the start-up report and
the entry point behind ``pretrain_gpt.py`` (:mod:`.main`).

Public API (imported lazily, so that ``megatron_h2.training.arguments`` stays light)::

    from megatron_h2.training import build_run, config_from_args, train

    cfg, launch = config_from_args(["--num-layers", "2", ...])  # pretrain_gpt.py's flags
    run = build_run(cfg, launch)                                # checks, then builds once
    try:
        progress = train(run)                                   # the loop
    finally:
        run.close()
"""

from importlib import import_module

_EXPORTS = {
    "config_from_args": "arguments", "LaunchOptions": "arguments",
    "Run": "build", "build_run": "build", "train": "loop", "Trainer": "loop",
    "StepRunner": "step", "StepResult": "step", "main": "main",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
