"""The run directory's records: who the run is, its append-only logs, its summary, its errors.

Layout of ``--run-dir``::

    LOCK             held (flock) by the job that owns the directory; names its PID and host
    checkpoints/     see aihpc.resilience.checkpoint
    metrics.jsonl    one line per step (rank 0)
    events.jsonl     start, load, checkpoints, faults, hangs (every rank, O_APPEND)
    heartbeat/       the watchdog's per-rank beats
    logs/            full tracebacks of failed ranks, one file per rank and attempt
    summary.json     the finished run (rank 0, replaced atomically)

Nothing here needs torch: the launcher checks the directory before any worker starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import time
import traceback
from pathlib import Path
from typing import Any

from aihpc._io import to_json
from aihpc.runspec import RunSpec
from aihpc.runspec.model import ModelSpec
from aihpc.runtime.records import (
    event_problem,
    lost_steps,
    metrics_problem,
    read_jsonl,
    repair_records,
    set_aside,
    steps_text,
    summary_problem,
)

__all__ = [
    "ERROR_LOG_ATTR",
    "DEFAULT_RANK_STORAGE_GBps",
    "Events",
    "data_fingerprint",
    "finished_summary",
    "logged_loss",
    "phase_bound_s",
    "process_start_unix",
    "read_summary",
    "repair_logs",
    "run_identity",
    "trim_metrics",
    "write_error_log",
    "write_summary",
]

log = logging.getLogger("aihpc.runtime")

# When the cluster spec gives no storage bandwidth, a rank that moves its checkpoint shard slower
# than this is treated as stalled (about a tenth of what one NVMe drive or one client of a
# parallel file system sustains, so a healthy save is far inside the bound).
DEFAULT_RANK_STORAGE_GBps = 0.1
# Bound = hang timeout + this many times the expected transfer time.
_TRANSFER_SLACK = 4.0
_FINGERPRINT_SPAN = 1 << 20  # bytes hashed at each end of a data file


def phase_bound_s(hang_timeout_s: float, rank_bytes: float, rank_GBps: float) -> float:
    """How long a rank may stay in a load, save or final-commit phase: the hang timeout plus
    four times the time its share of the checkpoint takes at the storage bandwidth."""
    return hang_timeout_s + _TRANSFER_SLACK * rank_bytes / (rank_GBps * 1e9)


def data_fingerprint(data: Path | None) -> str:
    """What identifies the training data: its size and the SHA-256 of its first and last MiB
    (a whole-file hash of a multi-TB corpus would delay every start)."""
    if data is None:
        return "the shipped sample (shakespeare.txt)"
    size = data.stat().st_size
    h = hashlib.sha256()
    with open(data, "rb") as f:
        h.update(f.read(_FINGERPRINT_SPAN))
        if size > _FINGERPRINT_SPAN:
            f.seek(max(_FINGERPRINT_SPAN, size - _FINGERPRINT_SPAN))
            h.update(f.read())
    return f"{size} bytes, sha256 {h.hexdigest()[:16]}"


def run_identity(spec: RunSpec, data: Path | None, tokenizer: str | None = None) -> dict[str, Any]:
    """The fields a checkpoint must share with the run that resumes it: the model's shape, the
    data (and its tokenizer, when one is given) and the seed. The parallel plan is not among
    them: a new plan reshards."""
    # a dense model's identity leaves out the MoE router's fields, so checkpoints written before
    # the spec had them still resume
    skip = {"name", "source"}
    if not spec.model.is_moe:
        skip |= {f.name for f in dataclasses.fields(ModelSpec) if f.name.startswith("moe_router")}
        skip.add("moe_aux_loss_coeff")
    ident: dict[str, Any] = {
        f"model.{f.name}": getattr(spec.model, f.name)
        for f in dataclasses.fields(ModelSpec)
        if f.name not in skip
    }
    ident["training.seed"] = spec.training.seed
    ident["data"] = data_fingerprint(data)
    if tokenizer is not None:  # absent for byte-level runs, so their checkpoints still resume
        from aihpc.runtime.text_data import tokenizer_fingerprint

        ident["tokenizer"] = tokenizer_fingerprint(tokenizer)
    return ident


def repair_logs(run_dir: Path) -> list[str]:
    """Before anything is appended: metrics.jsonl and events.jsonl checked line by line, a torn
    last line or a damaged line moved to ``NAME.damaged``; one line saying so for each."""
    return [
        *repair_records(run_dir / "metrics.jsonl", metrics_problem),
        *repair_records(run_dir / "events.jsonl", event_problem),
    ]


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """summary.json if it is sound (``records.summary_problem``), else None."""
    summary, _ = _summary(run_dir)
    return summary


def _summary(run_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(summary.json if sound, else None; what is wrong with it, None when sound or absent)."""
    path = run_dir / "summary.json"
    try:
        summary = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError, RecursionError) as err:
        return None, f"unreadable ({str(err)[:80]})"
    problem = summary_problem(summary)
    return (None, problem) if problem else (summary, None)


def _set_aside_damaged_summary(run_dir: Path) -> None:
    """A damaged summary.json is renamed, not overwritten, and named in one line."""
    _, problem = _summary(run_dir)
    if problem:
        dest = set_aside(run_dir / "summary.json")
        log.warning(
            "summary.json: %s; kept as %s, and a new summary is written from the checkpoint "
            "(the earlier sessions it listed are not carried over)",
            problem,
            dest.name,
        )


def finished_summary(run_dir: Path, spec: RunSpec) -> dict[str, Any] | None:
    """The summary of a run that already trained every step the spec asks for, else None."""
    _set_aside_damaged_summary(run_dir)
    summary = read_summary(run_dir)
    if summary and summary["final_step"] >= spec.training.train_steps:
        return summary
    return None


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    """Replace summary.json atomically; an extended run keeps the earlier sessions in
    ``history`` (their final step, restarts, requeues and resume point)."""
    _set_aside_damaged_summary(run_dir)
    previous = read_summary(run_dir)
    if previous and previous["final_step"] <= summary.get("resumed_from_step", -1):
        history = previous.pop("history", [])
        keys = (
            "final_step", "restarts", "requeues", "resumed_from_step", "world_size", "final_loss"
        )  # fmt: skip
        summary["history"] = [*history, {k: previous.get(k) for k in keys}]
    tmp = run_dir / "summary.json.tmp"
    tmp.write_text(to_json(summary, indent=2) + "\n")
    os.replace(tmp, run_dir / "summary.json")


# The attribute naming the log an exception's traceback was already written to (the trainer
# writes it before the process group's teardown; the command then does not write it again).
ERROR_LOG_ATTR = "aihpc_error_log"


def write_error_log(run_dir: Path, rank: int, attempt: int, err: BaseException) -> Path:
    """The full traceback of a failed rank, in ``logs/rank-R.attempt-A.log``; its path."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    path = logs / f"rank-{rank}.attempt-{attempt}.log"
    text = "".join(traceback.format_exception(err))
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    with open(path, "a") as f:
        f.write(f"--- {stamp} rank {rank} attempt {attempt} pid {os.getpid()}\n{text}")
    return path


class Events:
    """``events.jsonl``: append-only JSON lines shared by all ranks (one ``write`` with O_APPEND
    keeps a short line whole between processes)."""

    def __init__(self, path: Path, rank: int, attempt: int, generation: int = 0):
        self.path, self.rank, self.attempt = path, rank, attempt
        self.generation = generation  # in-process restarts before this one (0: not written)

    def __call__(self, event: str, **fields: Any) -> None:
        record = {
            "event": event,
            "rank": self.rank,
            "attempt": self.attempt,
            "time_unix": time.time(),
            **fields,
        }
        if self.generation and "generation" not in record:
            record["generation"] = self.generation
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (to_json(record) + "\n").encode())
        finally:
            os.close(fd)


def process_start_unix() -> float | None:
    """When this process was created (Linux /proc), for the recovery-time split.

    Age from /proc/uptime minus the start tick, subtracted from time.time(): one clock, unlike
    /proc/stat's whole-second btime.
    """
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def trim_metrics(path: Path, keep_through: int) -> list[list[int]]:
    """On resume, drop logged steps past the checkpoint: they are about to be replayed. The
    steps up to it that metrics.jsonl has no line for are returned as [first, last] ranges, and
    said lost in one line: no other record holds every step's loss (events.jsonl holds the
    loss of each checkpointed step, which ``logged_loss`` falls back on)."""
    read = read_jsonl(path, metrics_problem)  # repair_logs set damaged lines aside already
    kept, seen = [], set()
    for _, line, rec in read.sound:
        if rec["step"] <= keep_through and rec["step"] not in seen:
            seen.add(rec["step"])
            kept.append(line)
    if path.exists():
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(b"".join(line + b"\n" for line in kept))
        os.replace(tmp, path)
    lost = lost_steps(seen, keep_through)
    if lost:
        what = "is missing" if not path.exists() else "was empty" if not seen else "has gaps"
        log.warning(
            "metrics.jsonl %s: the loss history of step(s) %s, before the resume from step %d, "
            "is lost",
            what,
            steps_text(lost),
            keep_through,
        )
    return lost


def logged_loss(path: Path, step: int) -> float | None:
    """The loss metrics.jsonl logged at ``step`` (exact, from its hex); where metrics.jsonl lost
    it, the loss events.jsonl recorded with the checkpoint of ``step``; else None."""
    for _, _, rec in reversed(read_jsonl(path, metrics_problem).sound):
        if rec["step"] == step:
            return float.fromhex(rec["loss_hex"])
    for _, _, rec in reversed(read_jsonl(path.with_name("events.jsonl"), event_problem).sound):
        hexed = rec.get("loss_hex")
        saved = rec["event"] == "checkpoint_saved" and rec.get("step") == step
        if saved and isinstance(hexed, str):
            with contextlib.suppress(ValueError):
                return float.fromhex(hexed)
    return None
