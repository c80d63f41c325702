"""`aihpc train` run as a real subprocess, for the runtime tests (shared by CPU and GPU tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def train(
    spec: Path, run_dir: Path, *extra: str, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``aihpc train SPEC --run-dir RUN_DIR --json EXTRA...`` with ``env`` added to os.environ."""
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
        timeout=timeout,
    )
