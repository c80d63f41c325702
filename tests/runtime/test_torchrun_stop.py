"""`python -m aihpc.runtime.torchrun` (torchrun's agent for `aihpc train`, as the sbatch script
runs it): a signal ends the job with one line, no traceback; exit 0 when the ranks stopped with
their checkpoint committed, 128 + the signal otherwise. Real torchrun agent and gloo workers;
the same under Slurm is in tests/interop/test_interop_slurm.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aihpc.resilience.manifest import verify_checkpoint
from aihpc.runtime.launch import stop_report

ROOT = Path(__file__).resolve().parents[2]


def _spec(tmp: Path) -> Path:
    text = (ROOT / "examples" / "tiny-train.toml").read_text()
    for old, new in [
        ("train_steps = 40", "train_steps = 400"),
        ("micro_batch_size = 4", "micro_batch_size = 2"),
        ("global_batch_size = 16", "global_batch_size = 4"),
        ("interval_steps = 10", "interval_steps = 200"),  # no save but the signal's
    ]:
        text = text.replace(old, new)
    path = tmp / "run.toml"
    path.write_text(text)
    return path


def _agent(spec: Path, run_dir: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    env.pop("SLURM_PROCID", None)
    cmd = [sys.executable, "-m", "aihpc.runtime.torchrun", "--standalone", "--nproc-per-node",
           "2", "-m", "aihpc", "train", str(spec), "--run-dir", str(run_dir), *extra]  # fmt: skip
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(what, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)


def _events(run_dir: Path, name: str) -> list[dict]:
    try:
        lines = (run_dir / "events.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [e for e in map(json.loads, lines) if e["event"] == name]


def _steps(run_dir: Path) -> int:
    try:
        return len((run_dir / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


@pytest.mark.slow
def test_signal_mid_training_ends_in_one_line_after_the_checkpoint(tmp_path: Path) -> None:
    """SIGTERM to the agent, twice (Slurm, then a user's scancel): the ranks finish the step
    and commit its checkpoint, the agent waits for them through the second signal, and the last
    line says where they stopped; exit 0."""
    run_dir = tmp_path / "run"
    proc = _agent(_spec(tmp_path), run_dir)
    _wait_for(lambda: _steps(run_dir) >= 3, proc)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err
    (step,) = {e["step"] for e in _events(run_dir, "preempted")}
    assert err.splitlines()[-1] == (
        f"aihpc: stopped by SIGTERM after step {step} with its checkpoint committed; "
        f"a requeued or resubmitted job resumes from step {step}"
    )
    verify_checkpoint(run_dir / "checkpoints" / f"step_{step:08d}")


@pytest.mark.slow
def test_signal_before_a_checkpoint_says_so(tmp_path: Path) -> None:
    """A signal while the ranks start (no step trained, nothing saved): one line saying there is
    no checkpoint to resume from, and exit 128 + SIGTERM. Rank 0 stalls at its start, so no
    rank reaches the loop that would save."""
    run_dir = tmp_path / "run"
    proc = _agent(_spec(tmp_path), run_dir, "--inject", "hang:at=start:mode=stall")
    _wait_for(lambda: len(_events(run_dir, "process_start")) == 2, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err
    assert err.splitlines()[-1] == (
        "aihpc: stopped by SIGTERM before the ranks saved a final checkpoint; "
        "a requeued or resubmitted job starts over: no checkpoint was committed"
    )


def _commit(run_dir: Path, step: int) -> None:
    folder = run_dir / "checkpoints" / f"step_{step:08d}"
    folder.mkdir(parents=True)
    (folder / "MANIFEST.json").write_text("{}")


def _event(run_dir: Path, name: str, at: float, **fields) -> None:
    with open(run_dir / "events.jsonl", "a") as f:
        f.write(json.dumps({"event": name, "rank": 0, "time_unix": at, **fields}) + "\n")


def test_stop_report_reads_this_launch_only(tmp_path: Path) -> None:
    """Only what the ranks recorded since this launch began counts: a preemption of an earlier
    attempt (the requeued job's first run) is not this one's."""
    _commit(tmp_path, 10)
    _event(tmp_path, "preempted", 100.0, step=10, signal=15)
    code, line = stop_report(tmp_path, signal.SIGTERM, since=200.0)
    assert code == 128 + signal.SIGTERM
    assert line.endswith("resumes from step 10, the newest committed checkpoint")
    assert stop_report(tmp_path, signal.SIGTERM, since=50.0)[0] == 0
    _event(tmp_path, "preempted", 300.0, step=12, signal=15)  # step 12 never committed
    assert stop_report(tmp_path, signal.SIGTERM, since=200.0)[0] == 128 + signal.SIGTERM
    _event(tmp_path, "done", 310.0, step=12)
    code, line = stop_report(tmp_path, signal.SIGUSR1, since=200.0)
    assert code == 0 and line == "aihpc: SIGUSR1 came after training finished at step 12"
