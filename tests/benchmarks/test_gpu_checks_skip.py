"""benchmarks/gpu_checks.sh without a GPU: one line saying it skipped, exit 0, nothing run or
written beside its log; a wrong step list is still refused (exit 2). CUDA_VISIBLE_DEVICES=""
hides any GPU, so this holds on a GPU machine too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _run(out: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(BENCH / "gpu_checks.sh"), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", **env},
    )


def test_no_gpu_skips_cleanly(tmp_path: Path) -> None:
    proc = _run(tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "skipped, no CUDA GPU" in lines[0]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["gpu_checks.log"]
    assert "step" not in (tmp_path / "out" / "gpu_checks.log").read_text().split("skipped")[0]


def test_an_unknown_step_is_refused_before_anything_runs(tmp_path: Path) -> None:
    proc = _run(tmp_path / "out", GPU_CHECKS_STEPS="12 13")
    assert proc.returncode == 2
    said = proc.stdout + proc.stderr  # the script tees both into its log
    assert "no step '13'" in said and "1 to 12" in said and "skipped" not in said


def test_the_compile_step_skips_without_a_gpu(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "compile_step.py"), "--results", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "compile_step.py: skipped, no CUDA GPU visible"
    assert not (tmp_path / "r").exists()
