"""``python -m aihpc.runtime.torchrun``: torchrun (``torch.distributed.run``, the same arguments)
for ``aihpc train``, whose stop on a signal ends in one line instead of a traceback.

Slurm sends SIGTERM to every process of a job's steps on ``scontrol requeue``, preemption and
``scancel``, and the batch script ``aihpc launch`` writes passes the time limit's warning
on the same way. torchrun's agent turns the signal into ``SignalException``: it signals its
workers, which finish their step, checkpoint and exit (aihpc.resilience.preempt), then raises it
again, so the log of every preempted attempt ended in a Python traceback and the node's task
exited 1, as if it had failed. Here the same agent runs, and a signal ends it with one line
(``launch.stop_report``): the step the ranks stopped at, or the checkpoint a rerun resumes from.
It exits 0 when the ranks stopped with their checkpoint committed (the preemption went as
designed: no ``srun: error`` line, and ``srun --kill-on-bad-exit`` does not end the other nodes'
tasks), else 128 + the signal. Any other ending is torchrun's own.

A second signal while the agent waits for its workers is ignored: torchrun would raise again
mid-wait and leave, and its workers die with it (``PR_SET_PDEATHSIG``) before their checkpoint
is committed. How long the agent waits is torchrun's ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (30 s
unless set; the sbatch script sets its ``--signal-lead``).

Ranks whose first failure exits 2 refused their input (a run directory another job holds, a plan the
workers cannot train): rank 0 printed the one line, and the agent exits 2 with it, where
torchrun itself would add its failure report and a traceback and exit 1.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from types import FrameType

from aihpc.runtime.launch import _cheap_rendezvous_event_names, stop_report

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv`` (``sys.argv[1:]``); the exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    argv = sys.argv[1:] if argv is None else argv
    run_dir = _run_dir(argv)
    if run_dir is None:
        print("error: the workers' command needs aihpc train's --run-dir", file=sys.stderr)
        return 2
    since = time.time()
    _cheap_rendezvous_event_names()
    _first_signal_only()
    try:
        torchrun(argv)
    except SignalException as err:
        code, line = stop_report(run_dir, int(err.sigval), since)
        if os.environ.get("SLURM_PROCID", "0") == "0":  # one line per job, not per node
            print(line, file=sys.stderr, flush=True)
        return code
    except ChildFailedError as err:
        if err.get_first_failure()[1].exitcode == 2:  # the others: exit 2, or stopped after it
            return 2  # refused on input (another job's run dir): rank 0 said why, in one line
        raise
    return 0


def _run_dir(argv: list[str]) -> Path | None:
    """The ``--run-dir`` of the workers' ``aihpc train`` command."""
    for i, arg in enumerate(argv):
        if arg == "--run-dir" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if arg.startswith("--run-dir="):
            return Path(arg.split("=", 1)[1])
    return None


def _first_signal_only() -> None:
    """torchrun's handler raises ``SignalException`` on every signal it handles, also while the
    agent is stopping its workers after the first; from the second on, ignore them."""
    from torch.distributed.elastic.multiprocessing import api

    raise_signal = api._terminate_process_handler
    seen: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        if seen:
            return  # the agent is already stopping its workers: let them finish
        seen.append(signum)
        raise_signal(signum, frame)

    api._terminate_process_handler = handler  # PContext.start installs it by this name


if __name__ == "__main__":
    sys.exit(main())
