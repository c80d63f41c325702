"""Benchmark scripts answer --help and write where their user says, never by default into the
committed benchmarks/results/."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if not p.name.startswith("_"))


def test_every_script_takes_a_results_folder_and_names_no_results_path() -> None:
    assert len(SCRIPTS) >= 9
    for script in SCRIPTS:
        text = script.read_text()
        assert "add_results_arg(ap)" in text, f"{script.name}: no --results"
        # the committed folder is never a default written to (docs may name it)
        code = re.sub(r'""".*?"""', "", text, flags=re.S)
        assert not re.search(r"[\"']results[\"']", code), f"{script.name} writes to results/"


def test_goodput_table_help_and_results_folder(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(BENCH / "goodput_table.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert r.returncode == 0 and "--results DIR" in r.stdout, r.stderr
    assert list(tmp_path.iterdir()) == []  # --help ran nothing and wrote nothing
    r = subprocess.run(
        [sys.executable, str(BENCH / "goodput_table.py"), "--results", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    table = (tmp_path / "out" / "goodput_table.md").read_text()
    assert table.startswith("Produced by `python benchmarks/goodput_table.py --results ")
    assert "| 16,384 |" in table and "lost_work" not in table
