"""One job per run directory, however the job was launched.

``aihpc train`` alone, or with ``--nproc-per-node`` (its own elastic agent), holds
``RUN_DIR/LOCK`` in the launching process before any worker starts, and its workers are told so
(``TrainOptions.lock_held``). Under torchrun, srun or a script that calls ``aihpc.runtime.run``
no process outlives the ranks, so the job's rank 0 takes the lock for the job's lifetime (all
its in-process generations), and every other rank, on this node or another, learns the outcome
from the job's rendezvous store before it writes anything in the directory: the watchdog's
heartbeats, events, error logs. A refused job ends on every rank with exit 2, the one line
naming the holder said once, by rank 0.

The store key carries the torchelastic attempt: a restarted worker group (the same job) takes
the lock afresh, since its dead predecessor's ``flock`` died with it, and never reads the
previous attempt's verdict from a store the agent kept across restarts.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from aihpc.resilience import RunDirBusyError, RunDirLock
from aihpc.runspec import SpecError

__all__ = ["RunDirRefused", "hold_run_dir"]

_OK = "ok"


class RunDirRefused(SpecError):
    """The run directory is another job's. ``quiet`` on every rank but 0: one line per job."""

    def __init__(self, run_dir: Path, why: str, quiet: bool) -> None:
        super().__init__("--run-dir", str(run_dir), why)
        self.quiet = quiet


@contextmanager
def hold_run_dir(
    run_dir: Path, rank: int, world: int, attempt: int, store: Any = None
) -> Iterator[None]:
    """Rank 0 holds ``run_dir``'s lock while the block runs; every rank raises RunDirRefused
    when another job holds it. ``store`` (the job's rendezvous store) is needed when
    ``world > 1``: it carries rank 0's verdict to the others, before any process group."""
    key = f"aihpc/run_dir_lock/attempt{attempt}"
    lock, verdict = None, _OK
    if rank == 0:
        try:
            lock = RunDirLock(run_dir).acquire()
        except RunDirBusyError as err:
            verdict = err.describe()
        except OSError as err:  # e.g. Lustre without the flock mount option: ENOSYS
            verdict = f"cannot be locked ({err.strerror or err}); one job per directory needs flock"
        if world > 1:
            store.set(key, verdict)
    else:
        verdict = store.get(key).decode()
    if verdict != _OK:
        if world > 1:
            _all_read(store, key, rank, world)
        raise RunDirRefused(run_dir, verdict, quiet=rank != 0)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def _all_read(store: Any, key: str, rank: int, world: int) -> None:
    """Rank 0 leaves only once every rank has read the verdict: under srun the store lives in
    rank 0's process, and a rank still reading it would fail on a closed connection (exit 1,
    a traceback) instead of exiting 2."""
    if store.add(f"{key}/read", 1) == world:
        store.set(f"{key}/all_read", _OK)
    if rank == 0:
        store.wait([f"{key}/all_read"])
