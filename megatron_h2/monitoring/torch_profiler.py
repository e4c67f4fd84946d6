"""``--profile``: a torch.profiler trace of iterations ``--profile-step-start`` + 1 ..
``--profile-step-end`` on the ranks ``--profile-ranks``, as Megatron counts them (profiling
starts when that many steps are done and stops once the end step is done).

Each profiled rank writes one Chrome trace (chrome://tracing, ui.perfetto.dev, TensorBoard's
profiler plugin) to ``<--tensorboard-dir>/../torch_profile/rank-<R>.json.gz`` (Megatron's
place; ``./torch_profile`` without ``--tensorboard-dir``); every iteration is a
``iteration <N>`` range in it. The activities are every one torch.profiler supports here, so a
vendor's device shows where its torch plug-in reports to the profiler. On CUDA the profiled
steps are also bracketed by ``cudaProfilerStart`` / ``Stop`` (Megatron's ``--profile``, for
``nsys profile --capture-range=cudaProfilerApi``) unless ``--use-pytorch-profiler``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_h2.config import LoggingConfig


class StepProfiler:
    """Call :meth:`before` and :meth:`after` around every training iteration (1-based)."""

    def __init__(self, cfg: LoggingConfig, rank: int, device_type: str,
                 tensorboard_dir: str | None, log) -> None:
        self.enabled = cfg.profile and rank in cfg.profile_ranks
        self.first, self.last = cfg.profile_step_start + 1, cfg.profile_step_end
        root = Path(tensorboard_dir).parent if tensorboard_dir else Path(".")
        self.path = root / "torch_profile" / f"rank-{rank}.json.gz"
        self.nsys = device_type == "cuda" and not cfg.use_pytorch_profiler
        self.log = log
        self._prof: torch.profiler.profile | None = None
        self._range = None

    def before(self, iteration: int) -> None:
        if not self.enabled:
            return
        if iteration == self.first:
            self._prof = torch.profiler.profile(
                activities=list(torch.profiler.supported_activities()))
            self._prof.start()
            if self.nsys:
                torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
        if self._prof is not None:
            self._range = torch.profiler.record_function(f"iteration {iteration}")
            self._range.__enter__()

    def after(self, iteration: int) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self._prof is not None and iteration >= self.last:
            self._stop(iteration)

    def close(self, iteration: int) -> None:
        """End a profile the run stopped inside (exit signal, --exit-interval)."""
        if self._prof is not None:
            self._stop(iteration)

    def _stop(self, iteration: int) -> None:
        if self.nsys:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
        self._prof.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._prof.export_chrome_trace(str(self.path))
        self._prof = None
        self.log(f"profile of iterations {self.first}-{iteration}: {self.path} (open in "
                 "ui.perfetto.dev or chrome://tracing)")
