"""Which rank's failure the launcher names when several ranks of a job end at once: the rank
whose own error started it, even when the agent stopped that rank (SIGTERM) after its peers
had already failed on the connection it closed."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from aihpc.runtime.launch import describe_failure
from aihpc.runtime.rundir import write_error_log

PEER_LOST = RuntimeError(
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
    "[127.0.0.1]:4242 Check the logs of the remote worker before reporting an error."
)


class InjectedFault(RuntimeError):
    pass


def _log(run_dir: Path, rank: int, err: BaseException, pid: int) -> None:
    path = write_error_log(run_dir, rank, 0, err)
    text = path.read_text()
    # write_error_log stamps this process's pid; stand in for the worker that wrote it
    path.write_text(text.replace(f" pid {os.getpid()}\n", f" pid {pid}\n"))


def _failure(rank: int, pid: int, exitcode: int, tmp: Path) -> ProcessFailure:
    return ProcessFailure(rank, pid, exitcode, str(tmp / f"no-error-file-{rank}.json"))


@pytest.mark.parametrize(
    ("rank1_log_pid", "named"),
    [
        (1001, "rank 1 failed: "),  # rank 1 logged its error, then the agent stopped it
        (900, "rank 0 failed: RuntimeError: "),  # a stale log of an earlier process of rank 1
    ],
)
def test_a_stopped_rank_counts_by_the_error_its_own_process_logged(tmp_path, rank1_log_pid, named):
    _log(tmp_path, 0, PEER_LOST, pid=1000)
    _log(tmp_path, 1, InjectedFault("injected exception at step 3"), pid=rank1_log_pid)
    failures = {
        0: _failure(0, 1000, 1, tmp_path),
        1: _failure(1, 1001, -int(signal.SIGTERM), tmp_path),
    }
    line = describe_failure(failures, tmp_path, 0)
    assert named in line
    if rank1_log_pid == 1001:
        assert "InjectedFault: injected exception at step 3" in line


def test_an_error_of_its_own_beats_a_lost_peer_whatever_the_order(tmp_path):
    _log(tmp_path, 1, InjectedFault("first"), pid=1001)
    _log(tmp_path, 0, PEER_LOST, pid=1000)
    failures = {
        0: _failure(0, 1000, 1, tmp_path),
        1: _failure(1, 1001, 1, tmp_path),
    }
    assert "rank 1 failed: " in describe_failure(failures, tmp_path, 0)
