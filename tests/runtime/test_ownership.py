"""aihpc.runtime.ownership over a real TCPStore, the ranks as threads (each with its own store
client, as processes have): a refused job raises on every rank, loud on rank 0 only, and rank 0
leaves only once every rank has read the verdict; a restarted attempt of the same job takes the
lock afresh and is not answered by the previous attempt's verdict. The multi-process runs under
each launcher are in test_run_dir_lock.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist

from aihpc.resilience import RunDirLock
from aihpc.runtime.distributed import free_port
from aihpc.runtime.ownership import RunDirRefused, hold_run_dir

WORLD = 3


def _stores() -> list[dist.TCPStore]:
    port = free_port()
    kw = {"world_size": WORLD, "timeout": timedelta(seconds=60), "wait_for_workers": False}
    server = dist.TCPStore("127.0.0.1", port, is_master=True, **kw)
    return [server] + [dist.TCPStore("127.0.0.1", port, is_master=False, **kw) for _ in range(2)]


def _rank(run_dir, rank: int, attempt: int, store) -> str:
    try:
        with hold_run_dir(run_dir, rank, WORLD, attempt, store):
            return "held" if rank == 0 else "ok"
    except RunDirRefused as err:
        return f"quiet: {err}" if err.quiet else f"said: {err}"


def _job(run_dir, attempt: int, stores) -> list[str]:
    with ThreadPoolExecutor(WORLD) as pool:
        return list(pool.map(lambda r: _rank(run_dir, r, attempt, stores[r]), range(WORLD)))


def test_refused_on_every_rank_said_once_then_a_restart_takes_it(tmp_path):
    stores = _stores()
    other = RunDirLock(tmp_path).acquire()  # another job's
    refused = _job(tmp_path, 0, stores)
    assert refused[0].startswith("said: --run-dir") and "is in use by PID" in refused[0]
    assert all(r.startswith("quiet: --run-dir") for r in refused[1:]), refused
    assert stores[0].add("aihpc/run_dir_lock/attempt0/read", 0) == WORLD  # all read it
    other.release()
    # the next attempt of the same job, over the same store: its own verdict, the lock its own
    assert _job(tmp_path, 1, stores) == ["held", "ok", "ok"]
    RunDirLock(tmp_path).acquire().release()  # released when the job's block ended


def test_a_single_process_needs_no_store(tmp_path):
    with hold_run_dir(tmp_path, 0, 1, 0), pytest.raises(RunDirRefused) as err:
        hold_run_dir(tmp_path, 0, 1, 0).__enter__()
    assert not err.value.quiet and "is in use by PID" in str(err.value)
