"""`aihpc train` run as a real subprocess, for the runtime tests (shared by CPU and GPU tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hang_bounds import hang_guard_s


def train(
    spec: Path, run_dir: Path, *extra: str, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``aihpc train SPEC --run-dir RUN_DIR --json EXTRA...`` with ``env`` added to os.environ;
    ``timeout`` is for a machine running the suite alone, stretched by the load measured now."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "aihpc",
            "train",
            str(spec),
            "--run-dir",
            str(run_dir),
            "--json",
            *extra,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=hang_guard_s(timeout),
    )


def ok(proc: subprocess.CompletedProcess) -> dict:
    """The run's --json summary, after checking it exited 0 (its stderr tail as the message)."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def losses(run_dir: Path) -> list[tuple[int, str]]:
    """(step, loss as float.hex) per logged step, from metrics.jsonl."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss_hex"]) for r in rows]


def events(run_dir: Path, name: str) -> list[dict]:
    """The run's events.jsonl records named ``name``, in order."""
    rows = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    return [r for r in rows if r["event"] == name]
