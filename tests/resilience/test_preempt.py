"""SIGTERM / SIGUSR1 during training: the ranks finish the step, checkpoint, and exit 128 +
signal; rerunning resumes from that checkpoint and ends in the state of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _spec(tmp: Path, steps: int) -> Path:
    text = (ROOT / "examples" / "tiny-train.toml").read_text()
    text = text.replace("train_steps = 40", f"train_steps = {steps}")
    text = text.replace("micro_batch_size = 4", "micro_batch_size = 2")
    text = text.replace("global_batch_size = 16", "global_batch_size = 4")
    text = text.replace("interval_steps = 10", "interval_steps = 100")
    path = tmp / "run.toml"
    path.write_text(text)
    return path


def _train(spec: Path, run_dir: Path, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "aihpc", "train", str(spec), "--run-dir", str(run_dir), "--json"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def _steps_logged(run_dir: Path) -> int:
    try:
        return len((run_dir / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


@pytest.mark.slow
def test_signal_checkpoints_and_resume_matches(tmp_path: Path) -> None:
    sig = signal.SIGUSR1  # SIGTERM takes the same path (tests/interop/test_interop_slurm.py)
    spec = _spec(tmp_path, 40)
    run_dir = tmp_path / "run"
    proc = _train(spec, run_dir)
    deadline = time.monotonic() + 120
    while _steps_logged(run_dir) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err.decode()[-2000:]
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    stop = [e for e in events if e.get("event") == "preempted"]
    assert len(stop) == 1 and stop[0]["signal"] == sig
    step = stop[0]["step"]
    assert 3 <= step < 40 and (run_dir / "checkpoints" / f"step_{step:08d}").is_dir()
    # a rerun resumes at that step and ends where an uninterrupted run ends
    spec_short = spec
    resumed = _train(spec_short, run_dir)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err.decode()[-2000:]
    summary = json.loads(out)
    assert summary["resumed_from_step"] == step
    straight_dir = tmp_path / "straight"
    straight = _train(spec_short, straight_dir)
    out2, err2 = straight.communicate(timeout=300)
    assert straight.returncode == 0, err2.decode()[-2000:]
    assert summary["state_sha256"] == json.loads(out2)["state_sha256"]


def test_watch_records_the_signal_and_restores_handlers(monkeypatch: pytest.MonkeyPatch) -> None:
    from aihpc.resilience.preempt import PreemptWatch

    monkeypatch.delenv("AIHPC_ELASTIC_AGENT", raising=False)
    before = signal.getsignal(signal.SIGUSR1)
    with PreemptWatch() as watch:
        assert watch.active and watch.agreed() == 0
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)
        assert watch.agreed() == signal.SIGUSR1  # one process: no collective
    assert signal.getsignal(signal.SIGUSR1) is before and not watch.active
    monkeypatch.setenv("AIHPC_ELASTIC_AGENT", "1")  # our agent's SIGTERM is a teardown
    with PreemptWatch() as watch:
        assert not watch.active and signal.getsignal(signal.SIGTERM) is not watch._handle
