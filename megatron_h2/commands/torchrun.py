"""torchrun, with a clean end on SIGTERM: ``python -m megatron_h2.commands.torchrun ARGS`` takes
exactly torchrun's arguments (``scripts/run_local.sh`` and ``scripts/slurm_pretrain.sh`` use it).

torchrun forwards a SIGTERM (from the user, or from SLURM at a job's time limit) to its workers,
waits for them, and then exits 1 with a SignalException traceback, even when every worker saved
and stopped as asked (``--exit-signal-handler``). Here the workers mark a normal end (see
:mod:`megatron_h2.monitoring.watchdog`), and a stop by signal ends with one line and exit status
0 when every worker of this node marked it, 1 (naming the others) when some did not.
"""

from __future__ import annotations

import os
import sys
import tempfile

from megatron_h2.monitoring.watchdog import STOPPED_ENV, stopped_local_ranks


def signal_verdict(signal_name: str, workers: int, stopped: list[int]) -> tuple[int, str]:
    """Exit status and one-line report of a launch stopped by ``signal_name``, given the local
    ranks (of ``workers``) that marked a normal end."""
    missing = [r for r in range(workers) if r not in stopped]
    if not missing:
        return 0, (f"megatron_h2: {signal_name} received; all {workers} workers of this node "
                   "saved and stopped")
    names = ", ".join(map(str, missing))
    return 1, (f"error: {signal_name} received; local rank(s) {names} of {workers} did not save "
               "and stop (without --exit-signal-handler a worker ends at once on SIGTERM); "
               "resume from the last complete checkpoint")


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv``; its exit status, or the verdict of a stop by signal."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.parse_args(argv)
    workers = torchrun.determine_local_world_size(args.nproc_per_node)
    with tempfile.TemporaryDirectory(prefix="megatron_h2-stopped-") as folder:
        os.environ[STOPPED_ENV] = folder
        try:
            torchrun.run(args)
        except SignalException as exc:
            code, line = signal_verdict(exc.sigval.name, workers, stopped_local_ranks(folder))
            print(line, file=sys.stderr if code else sys.stdout, flush=True)
            return code
        except ChildFailedError as exc:
            print(exc.format_msg(), file=sys.stderr, flush=True)  # torchrun's summary
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
