"""Start torchrun's elastic agent in this process, with the training command as its workers,
and, when the job fails for good, say in one line what failed first and how to resume; when a
signal stops the job (Slurm's preemption, requeue or scancel), say in one line where the ranks
stopped and what a rerun resumes from."""

from __future__ import annotations

import json
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

from aihpc.resilience.manifest import committed_checkpoints
from aihpc.resilience.watchdog import HANG_EXIT_CODE, ORPHAN_EXIT_CODE
from aihpc.runtime.distributed import free_port

__all__ = ["describe_failure", "launch_elastic", "stop_report"]


def launch_elastic(
    nproc_per_node: int,
    max_restarts: int,
    worker_args: list[str],
    run_dir: Path,
    monitor_interval_s: float = 0.1,
) -> tuple[int, str]:
    """Run ``python -m aihpc <worker_args>`` on ``nproc_per_node`` local workers under the
    torchelastic agent; restart the whole group up to ``max_restarts`` times.

    Returns (0, "") or (1, the one line that says what failed first and how to resume).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # With the shared rendezvous store, restarted gloo workers read the dead generation's
    # addresses and fail (pytorch#135712); a store per attempt makes restarts reliable.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    os.environ["AIHPC_ELASTIC_AGENT"] = "1"  # workers leave the summary to the agent
    # Workers die with this process (PR_SET_PDEATHSIG, then a parent check by their watchdog),
    # so a SIGKILL of the launcher or of its process group leaves no orphan training on.
    os.environ["AIHPC_AGENT_PID"] = str(os.getpid())
    if nproc_per_node > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    _cheap_rendezvous_event_names()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc_per_node,
        run_id=f"aihpc-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=max_restarts,
        monitor_interval=monitor_interval_s,
        start_method="spawn",
    )
    try:
        elastic_launch(config, sys.executable)("-m", "aihpc", *worker_args)
    except ChildFailedError as err:
        return 1, describe_failure(err.failures, run_dir, max_restarts)
    return 0, ""


def _cheap_rendezvous_event_names() -> None:
    """torch's dynamic rendezvous names each event it logs by calling ``inspect.stack()`` twice,
    which reads the source lines of every frame and, under ``python -m`` (runpy frames), scans
    all loaded modules per frame: 0.2-0.6 s per event measured here (two cores), nine events a
    launch and more per restart, in the agent's critical path before any worker starts. The same
    name (the function ``depth`` frames up) comes from the frame objects directly."""
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    except ImportError:
        return
    if not callable(getattr(dynamic_rendezvous, "get_method_name", None)):
        return

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:  # the stack is shallower than depth
            return "no_method_name"

    dynamic_rendezvous.get_method_name = get_method_name


def _cause(rank: int, failure: Any, run_dir: Path) -> str:
    code = failure.exitcode
    logged = _logged_by(run_dir, rank, failure)
    if code < 0 and -code in _TEARDOWN_SIGNALS and logged is not None:
        return f"rank {rank} failed: {logged}"  # stopped while tearing down after its error
    if code < 0:
        return f"rank {rank} was killed by {_signal_name(-code)}"
    if code == HANG_EXIT_CODE:
        hang = _last_event(run_dir, "hang_detected")
        where = f" in phase {hang.get('phase')} after step {hang.get('step')}" if hang else ""
        return f"rank {rank}'s watchdog found a hang{where}"
    if code == ORPHAN_EXIT_CODE:
        return f"rank {rank} lost its launcher"
    line = _last_error_line(run_dir, rank)
    return f"rank {rank} failed: {line}" if line else f"rank {rank} exited with code {code}"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# Ways a rank ends that follow from another rank's failure, not cause one: the agent's SIGTERM
# to the survivors, and the collective errors of ranks whose peer vanished.
_TEARDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Connection refused",
    "Broken pipe",
    "timed out",
    "pair closure",  # gloo: "Application timeout caused pair closure"
    "Socket closed",
    "ECONNRESET",
    # torch 2.13's gloo ends a collective error caused by a vanished peer with this (the line
    # may be cut before the transport's own "Connection closed" text)
    "Check the logs of the remote worker",
)


def _rank_order(run_dir: Path, rank: int, failure: Any) -> tuple[int, float]:
    """Sort key: a rank killed by a signal of its own or found hung first, then ranks that
    raised an error of their own, then those that lost a peer, then those the agent stopped.
    A rank the agent stopped after it had logged an error (the trainer logs a fatal error
    before tearing the process group down, which is when its peers fail) counts by that error."""
    code = failure.exitcode
    logged = _logged_by(run_dir, rank, failure) if -code in _TEARDOWN_SIGNALS else None
    if logged is not None:  # it wrote its error, then the agent stopped it
        kind = 2 if any(p in logged for p in _PEER_LOST) else 1
    elif code < 0:
        kind = 3 if -code in _TEARDOWN_SIGNALS else 0
    elif code in (HANG_EXIT_CODE, ORPHAN_EXIT_CODE):
        kind = 0
    else:
        line = _last_error_line(run_dir, rank) or ""
        kind = 2 if any(p in line for p in _PEER_LOST) else 1
    return kind, _error_time(run_dir, rank) or failure.timestamp


def describe_failure(failures: dict[int, Any], run_dir: Path, max_restarts: int) -> str:
    """One line: the failure that came first (a killed or hung rank before the ranks that then
    lost their peer), the restarts used, and where a rerun resumes."""
    if failures:
        rank, failure = min(failures.items(), key=lambda kv: _rank_order(run_dir, *kv))
        cause = _cause(rank, failure, run_dir)
    else:
        cause = "a worker failed"
    committed, _ = committed_checkpoints(run_dir / "checkpoints")
    resume = (
        f"rerun the same command to resume from step {committed[-1].step}"
        if committed
        else "no checkpoint was committed; rerun the same command to start over"
    )
    return f"training failed after {max_restarts} restart(s): {cause}; {resume}"


def stop_report(run_dir: Path, signum: int, since: float) -> tuple[int, str]:
    """(exit code, one line) for an agent that ``signum`` stopped, from what the ranks recorded
    after ``since`` (this launch's start): 0 when they stopped after a step whose checkpoint is
    committed (aihpc.resilience.preempt: a preemption handled as designed), or when training
    had finished; else 128 + ``signum``, naming the checkpoint a rerun resumes from."""
    name = _signal_name(signum)
    committed = [c.step for c in committed_checkpoints(run_dir / "checkpoints")[0]]
    stopped = _last_event(run_dir, "preempted", since)
    if stopped is not None and stopped.get("step") in committed:
        step = stopped["step"]
        return 0, (
            f"aihpc: stopped by {name} after step {step} with its checkpoint committed; "
            f"a requeued or resubmitted job resumes from step {step}"
        )
    done = _last_event(run_dir, "done", since)
    if done is not None:
        return 0, f"aihpc: {name} came after training finished at step {done.get('step')}"
    resume = (
        f"resumes from step {committed[-1]}, the newest committed checkpoint"
        if committed
        else "starts over: no checkpoint was committed"
    )
    return 128 + signum, (
        f"aihpc: stopped by {name} before the ranks saved a final checkpoint; "
        f"a requeued or resubmitted job {resume}"
    )


def _attempt_logs(run_dir: Path, rank: int) -> list[Path]:
    return sorted(
        (run_dir / "logs").glob(f"rank-{rank}.attempt-*.log"), key=lambda p: p.stat().st_mtime
    )


def _error_time(run_dir: Path, rank: int) -> float | None:
    logs = _attempt_logs(run_dir, rank)
    return logs[-1].stat().st_mtime if logs else None


def _log_lines(run_dir: Path, rank: int) -> list[str]:
    """The non-blank lines of the rank's newest log."""
    logs = _attempt_logs(run_dir, rank)
    if not logs:
        return []
    return [ln for ln in logs[-1].read_text(errors="replace").splitlines() if ln.strip()]


def _last_error_line(run_dir: Path, rank: int) -> str | None:
    """The exception line (``Type: message``) ending the rank's newest traceback."""
    lines = _log_lines(run_dir, rank)
    return lines[-1][:300] if lines else None


def _logged_by(run_dir: Path, rank: int, failure: Any) -> str | None:
    """The error line of the rank's newest log if that process itself wrote it (the log's last
    header, ``write_error_log``'s, names its pid), else None."""
    lines = _log_lines(run_dir, rank)
    headers = [ln for ln in lines if ln.startswith("--- ")]
    pid = getattr(failure, "pid", None)
    if pid is None or not headers or not headers[-1].endswith(f" pid {pid}"):
        return None
    return lines[-1][:300] if headers[-1] != lines[-1] else None


def _last_event(run_dir: Path, name: str, since: float = 0.0) -> dict[str, Any] | None:
    """The last event ``name`` in events.jsonl recorded at ``since`` or later."""
    try:
        lines = (run_dir / "events.jsonl").read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == name:
            stamp = event.get("time_unix")
            late = isinstance(stamp, int | float) and stamp >= since
            return event if late or not since else None
    return None
