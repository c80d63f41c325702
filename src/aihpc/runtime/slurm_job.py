"""``python -m aihpc.runtime.slurm_job``: what the batch script of ``aihpc launch`` asks at the
start of an attempt and before it requeues the job, answered from the run directory.

- ``start RUN_DIR JOB_ID REQUEUES MAX_REQUEUES PORT`` prints ``PORT STEP``: torchrun's c10d
  rendezvous port (``PORT`` when not 0, else the first free one on this node, the allocation's
  first, from one the job id picks in 20000..31999, below Linux's ephemeral ports, so two jobs
  sharing a node rarely start on the same candidate) and the newest committed checkpoint's
  step (-1: none). A job requeued more than MAX_REQUEUES times prints one line and exits 1
  instead: it stops here rather than start once more.
- ``requeue RUN_DIR JOB_ID REQUEUES MAX_REQUEUES START_STEP START_TIME`` prints one line and
  exits 0 when the job should requeue: a checkpoint newer than START_STEP is committed and
  verifies against its manifest (``aihpc.resilience.manifest.verify_checkpoint``), and the job
  was requeued fewer than MAX_REQUEUES times. It exits 3 when training finished in this
  attempt (nothing to requeue) and 1 when the job must stop: no newer checkpoint (a requeue
  would stop the same way, saving nothing), one that does not verify, or the cap reached.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

from aihpc.resilience.manifest import (
    CheckpointCorruptError,
    committed_checkpoints,
    manifest_bytes,
    verify_checkpoint,
)

__all__ = ["RDZV_PORTS", "main", "newest_committed", "rdzv_port", "requeue_decision"]

RDZV_PORTS = range(20000, 32000)  # unprivileged and below Linux's ephemeral range (32768-)
# Hashing more than this at the time limit would outlast --signal-lead: a bigger checkpoint has
# its files checked against the manifest's sizes; the loader hashes it when the job resumes.
VERIFY_HASH_MAX_BYTES = 16 * 2**30
REQUEUE, STOP, FINISHED = 0, 1, 3


def rdzv_port(job_id: int, fixed: int = 0) -> int:
    """``fixed``, or the first port free on this host from the one ``job_id`` picks."""
    if fixed:
        return fixed
    first = job_id % len(RDZV_PORTS)
    for i in range(len(RDZV_PORTS)):
        port = RDZV_PORTS[(first + i) % len(RDZV_PORTS)]
        with socket.socket() as s:
            try:
                s.bind(("", port))  # torchrun's TCP store listens on every interface
            except OSError:
                continue
        return port
    raise OSError(f"no free port in {RDZV_PORTS.start}..{RDZV_PORTS.stop - 1}")


def _done_since(run_dir: Path, since: float) -> dict | None:
    """The trainer's ``done`` event recorded at ``since`` or later (read here rather than
    through aihpc.runtime.launch, which loads torch: seconds of a node's time limit)."""
    try:
        lines = (run_dir / "events.jsonl").read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if not isinstance(event, dict):
            continue
        stamp = event.get("time_unix")
        if event.get("event") == "done" and isinstance(stamp, int | float) and stamp >= since:
            return event
    return None


def newest_committed(run_dir: Path) -> int:
    """The newest committed checkpoint's step, -1 when there is none."""
    committed, _ = committed_checkpoints(run_dir / "checkpoints")
    return committed[-1].step if committed else -1


def _check(path: Path) -> str:
    """Verify the checkpoint (its files' sizes only when hashing it would take minutes);
    how it was checked. CheckpointCorruptError when it does not verify."""
    if manifest_bytes(path) <= VERIFY_HASH_MAX_BYTES:
        verify_checkpoint(path)
        return "verified"
    from aihpc.resilience.manifest import read_manifest

    for name, meta in read_manifest(path)["files"].items():
        f = path / name
        if not f.is_file() or f.stat().st_size != meta["size"]:
            raise CheckpointCorruptError(f"{f}: missing or not the size its manifest records")
    return "its files' sizes checked"


def requeue_decision(
    run_dir: Path, job_id: str, requeues: int, max_requeues: int, start_step: int, since: float
) -> tuple[int, str]:
    """(REQUEUE | STOP | FINISHED, one line) at the time limit's warning, after the ranks
    stopped."""
    done = _done_since(run_dir, since)
    if done is not None:
        return FINISHED, f"aihpc: training finished at step {done.get('step')}; nothing to requeue"
    committed, _ = committed_checkpoints(run_dir / "checkpoints")
    newer = [c for c in committed if c.step > start_step]
    since_what = f"step {start_step}" if start_step >= 0 else "the start (none before)"
    if not newer:
        return STOP, (
            f"aihpc: no checkpoint newer than {since_what} was committed in this attempt; "
            f"job {job_id} ends here, not requeued: a requeue would stop the same way, saving "
            "nothing (a longer --time, or a shorter checkpoint interval, lets it save)"
        )
    newest = newer[-1]
    try:
        how = _check(newest.path)
    except (CheckpointCorruptError, OSError, KeyError, ValueError) as err:
        return STOP, (
            f"aihpc: checkpoint step {newest.step} does not verify ({err}); job {job_id} ends "
            "here, not requeued"
        )
    if requeues >= max_requeues:
        return STOP, (
            f"aihpc: checkpoint step {newest.step} committed ({how}); job {job_id} was "
            f"requeued {requeues} time(s), the cap (--max-requeues {max_requeues}): it ends "
            f"here, not requeued; a new sbatch of the script resumes from step {newest.step}"
        )
    return REQUEUE, (
        f"aihpc: checkpoint step {newest.step} committed ({how}); requeueing job {job_id} "
        f"(requeue {requeues + 1} of at most {max_requeues})"
    )


def _start(run_dir: Path, job_id: str, requeues: int, max_requeues: int, port: int) -> int:
    step = newest_committed(run_dir)
    if requeues > max_requeues:
        resume = f"resumes from step {step}" if step >= 0 else "starts over"
        print(
            f"aihpc: job {job_id} was requeued {requeues} times, over --max-requeues "
            f"{max_requeues}: not training; a new sbatch of the script {resume}",
            file=sys.stderr,  # stdout is the script's `read`
            flush=True,
        )
        return STOP
    print(rdzv_port(int(job_id), port), step, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        if len(args) == 6 and args[0] == "start":
            _, run_dir, job, requeues, cap, port = args
            return _start(Path(run_dir), job, int(requeues), int(cap), int(port))
        if len(args) == 7 and args[0] == "requeue":
            _, run_dir, job, requeues, cap, step, since = args
            code, line = requeue_decision(
                Path(run_dir), job, int(requeues), int(cap), int(step), float(since)
            )
            print(line, flush=True)
            return code
    except (ValueError, OSError) as err:
        print(f"aihpc: {' '.join(args[:1])}: {err}", file=sys.stderr, flush=True)
        return STOP
    print("usage: python -m aihpc.runtime.slurm_job start|requeue ...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
