"""Submitting the script ``aihpc launch`` writes, following the job, and saying how it ended.

The job's state is ``scontrol show job``'s while slurmctld remembers the job (``MinJobAge``,
300 s by default, after it ends), then ``sacct``'s where the site keeps accounting. The end is
reported as Slurm has it: a job cancelled while it was pending never ran and is not a success,
whatever exit code Slurm records for it (0); a job a signal ended exits 128 + the signal.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aihpc.runspec import SpecError

__all__ = ["FINAL_STATES", "JobState", "final_report", "follow_job", "job_state", "submit"]

# Job states after which the job will not run again (squeue/scontrol JobState names).
# PREEMPTED is final for a job Slurm will not requeue (PreemptMode=CANCEL); see JobState.final.
FINAL_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
    "DEADLINE", "SPECIAL_EXIT", "REVOKED",
}  # fmt: skip
# What each final state means, for the line that ends `aihpc launch --submit`.
_MEANING = {
    "FAILED": "the batch script exited non-zero",
    "TIMEOUT": "the time limit ended it",
    "NODE_FAIL": "a node of the job failed",
    "OUT_OF_MEMORY": "a step ran out of memory",
    "BOOT_FAIL": "a node failed to boot",
    "DEADLINE": "it missed its deadline",
    "PREEMPTED": "it was preempted and not requeued",
    "SPECIAL_EXIT": "it was held after a special exit",
    "REVOKED": "another cluster ran it",
}


def _run(cmd: list[str], flag: str = "--submit") -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise SpecError(flag, cmd[0], "Slurm's commands are not on PATH") from None
    except subprocess.TimeoutExpired:
        raise SpecError(flag, " ".join(cmd[:2]), "Slurm did not answer in 60 s") from None
    if done.returncode:
        raise SpecError(flag, " ".join(cmd[:2]), (done.stderr or done.stdout).strip()[:300])
    return done.stdout


def submit(script: Path) -> str:
    """sbatch the script; the job id."""
    return _run(["sbatch", "--parsable", str(script)]).strip().split(";")[0]


@dataclass(frozen=True)
class JobState:
    state: str
    reason: str
    exit_code: int | None
    signal: int | None
    restarts: int  # Slurm's Restarts: how many times the job was requeued (SLURM_RESTART_COUNT)
    nodes: str
    ran: bool = True  # it started at least once (RunTime above zero, or a node was given)
    requeue: bool = True  # Slurm may requeue it (scontrol's Requeue=1)

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES or (self.state == "PREEMPTED" and not self.requeue)


def _scontrol_state(job_id: str) -> JobState | None:
    try:
        done = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode:
        return None
    fields = dict(re.findall(r"(\w+)=(\S*)", done.stdout))
    code, _, sig = fields.get("ExitCode", "").partition(":")
    nodes = fields.get("NodeList", "")
    run_time = fields.get("RunTime", "")
    return JobState(
        state=fields.get("JobState", "UNKNOWN"),
        reason=fields.get("Reason", ""),
        exit_code=int(code) if code.isdigit() else None,
        signal=int(sig) if sig.isdigit() else None,
        restarts=int(fields.get("Restarts", "0") or 0),
        nodes=nodes if nodes != "(null)" else "",
        ran=bool(re.search(r"[1-9]", run_time)) or int(fields.get("Restarts", "0") or 0) > 0,
        requeue=fields.get("Requeue", "1") != "0",
    )


def _sacct_state(job_id: str) -> JobState | None:
    """The job as the accounting database has it (a site without it: None)."""
    try:
        done = subprocess.run(
            ["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode,Elapsed,NodeList"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    rows = [r.split("|") for r in done.stdout.splitlines() if r.count("|") == 3]
    if done.returncode or not rows:
        return None
    state, exit_code, elapsed, nodes = rows[-1]
    code, _, sig = exit_code.partition(":")
    words = state.split()  # "CANCELLED by 0"
    return JobState(
        state=words[0] if words else "UNKNOWN",
        reason="",
        exit_code=int(code) if code.isdigit() else None,
        signal=int(sig) if sig.isdigit() else None,
        restarts=0,  # sacct keeps no requeue count
        nodes="" if nodes in ("None assigned", "(null)") else nodes,
        ran=bool(re.search(r"[1-9]", elapsed)),
    )


def job_state(job_id: str) -> JobState | None:
    """The job as ``scontrol show job`` sees it, else as ``sacct`` does (None once neither
    knows it)."""
    return _scontrol_state(job_id) or _sacct_state(job_id)


def final_report(job_id: str, last: JobState, ran: bool) -> tuple[int, str]:
    """(exit code, one line) for a job that ended in ``last``; ``ran``: it was seen running
    (or Slurm says it ran). Only COMPLETED with exit 0 is 0; a signal is 128 + it; a job that
    ended without an exit code of its own (cancelled, failed to start) is 1."""
    again = f", requeues {last.restarts}" if last.restarts else ""
    code = last.exit_code or 0
    if last.state == "COMPLETED" and not code:
        return 0, f"job {job_id} COMPLETED{again}, exit code 0"
    if not code:
        code = 128 + last.signal if last.signal else 1
    if last.state == "CANCELLED":
        why = "cancelled while pending: it never ran" if not ran else "cancelled while running"
    else:
        why = _MEANING.get(last.state, "not completed")
        if not ran:
            why += "; it never ran"
    reason = f" ({last.reason})" if last.reason not in ("", "None") else ""
    return code, f"job {job_id} {last.state}{reason}{again}: {why}; exit code {code}"


def follow_job(
    job_id: str,
    log: Path,
    emit: Callable[[str], None],
    poll_s: float = 1.0,
    timeout_s: float | None = None,
) -> tuple[JobState | None, bool]:
    """Print the job's state changes and its new log lines until it ends; its last state, and
    whether it was ever seen running."""
    seen, offset, last, ran = "", 0, None, False
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        state = job_state(job_id)
        offset = _tail(log, offset, emit)
        if state is not None:
            last = state
            ran = ran or state.ran or state.state in ("RUNNING", "COMPLETING")
            label = (
                f"{state.state} ({state.reason})"
                if state.reason not in ("", "None")
                else state.state
            )
            key = f"{label} {state.restarts}"
            if key != seen:
                where = f" on {state.nodes}" if state.state == "RUNNING" and state.nodes else ""
                again = f", requeues {state.restarts}" if state.restarts else ""
                emit(f"job {job_id}: {label}{where}{again}")
                seen = key
        if state is None or state.final:
            _tail(log, offset, emit)
            return last, ran
        if deadline is not None and time.monotonic() > deadline:
            return last, ran
        time.sleep(poll_s)


def _tail(log: Path, offset: int, emit: Callable[[str], None]) -> int:
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return offset
    end = data.rfind(b"\n") + 1  # whole lines only
    for line in data[:end].decode(errors="replace").splitlines():
        emit(f"  | {line}")
    return offset + end
