"""Preemption: SIGTERM or SIGUSR1 during training → the ranks finish the step they are in, save
a checkpoint and exit with 128 + the signal's number.

Slurm sends SIGTERM before it kills a job (``scancel``, ``scontrol requeue``, preemption; then
SIGKILL after the cluster's KillWait) and, with ``#SBATCH --signal=B:USR1@120``, SIGUSR1 to the
batch script two minutes before the time limit; torchrun passes a SIGTERM on to its workers. A
signal reaches the ranks at different moments, so after every step the ranks agree (one
all-reduce of the largest signal seen) and stop together at the same step.

Under aihpc's own elastic agent (``aihpc train --nproc-per-node``) a worker's SIGTERM is the
agent tearing the group down after another worker failed, so there the default handlers stay
and the worker ends at once (the agent restarts the group from the last checkpoint).
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

__all__ = ["PREEMPT_SIGNALS", "PreemptWatch", "Preempted"]

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(SystemExit):
    """The run stopped for a signal after its checkpoint; the process exits 128 + signal."""

    def __init__(self, signum: int, step: int) -> None:
        super().__init__(128 + signum)
        self.signum, self.step = signum, step


class PreemptWatch:
    """Records the preemption signals this process receives while installed (main thread
    only; elsewhere it records nothing and the default handlers stay)."""

    def __init__(self) -> None:
        self.signum = 0
        self.active = False  # handlers installed: the ranks have something to agree on
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = max(self.signum, signum)

    def __enter__(self) -> PreemptWatch:
        own_agent = bool(os.environ.get("AIHPC_ELASTIC_AGENT"))
        if threading.current_thread() is threading.main_thread() and not own_agent:
            for sig in PREEMPT_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            self.active = True
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        self.active = False

    def agreed(self, group: Any = None, device: Any = None) -> int:
        """The largest signal any rank of ``group`` received (0: none), the same on every rank;
        a collective: every rank calls it at the same point (none where no rank watches: under
        aihpc's own agent every rank leaves the default handlers)."""
        import torch
        import torch.distributed as dist

        if not self.active or not dist.is_initialized() or dist.get_world_size(group) == 1:
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return int(flag.item())
