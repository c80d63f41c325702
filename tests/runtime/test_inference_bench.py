"""benchmarks/inference_vs_measured.py in its smallest mode: it decodes with the KV cache,
prices every row with the inference estimate for a host copy of the spec, and writes its
results; a bad grid value exits 2 with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from local_host_spec import HOST_COPY

from hang_bounds import hang_guard_s

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "inference_vs_measured.py"


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=hang_guard_s(120),
    )


@pytest.mark.slow
def test_tiny_grid_runs_and_prices_every_row(tmp_path):
    spec = tmp_path / "host.toml"
    spec.write_text(
        HOST_COPY.format(n=1).replace(
            'preset = "tiny-llama"', 'preset = "tiny-llama"\nseq_length = 32'
        )
    )
    args = ["--spec", str(spec), "--batches", "1", "2", "--prompts", "4"]
    r = run(*args, "--outputs", "3", "5", "--repeats", "1", "--results", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads((tmp_path / "inference_vs_measured.json").read_text())
    rows = data["rows"]
    assert [(r["kind"], r["batch"], r["prompt"], r["output"]) for r in rows[:3]] == [
        ("prefill", 1, 4, None),
        ("decode step", 1, 4, 3),
        ("decode step", 1, 4, 5),
    ]
    assert len(rows) == 2 * 3
    for row in rows:
        assert row["measured_s"] > 0 and row["wall_s"] > 0 and row["predicted_s"] > 0
        assert row["error"] == row["predicted_s"] / row["measured_s"] - 1
        assert row["terms_s"]["total_s"] == row["predicted_s"]
    host = data["host"]
    assert host["ops"]["layers"] == 2 and host["ops"]["decode"]["per_layer"] > 10
    assert set(data["summary"]) == {"all", "prefill", "decode"}
    assert "median |error|" in (tmp_path / "inference_vs_measured.md").read_text()


def test_bad_grid_value_exits_2_in_one_line(tmp_path):
    r = run("--batches", "0", "--results", str(tmp_path))
    assert r.returncode == 2
    assert r.stderr.strip() == "--batches 0: must be a whole number >= 1 (outputs >= 2)"
    assert not list(tmp_path.iterdir())
