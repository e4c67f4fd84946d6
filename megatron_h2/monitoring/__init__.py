"""Watching a run: Megatron-style log lines, TensorBoard and JSON-lines metrics
(:mod:`.metrics`), timers (:mod:`.timers`), per-stage compute accounting (:mod:`.stage_clock`),
pipeline timelines (:mod:`.timeline`), torch.profiler traces (:mod:`.torch_profiler`), numerical
health (:mod:`.health`), the in-training operator precision check (:mod:`.precision_monitor`)
and the orphan watchdog (:mod:`.watchdog`)."""
