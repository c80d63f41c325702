"""A user's own runs on the command line: `aihpc validate --runs` with runs alone (the template,
bad cells), `aihpc calibrate --runs` writing a calibration that `estimate` and `validate` use."""

from __future__ import annotations

import csv
import io
import json
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aihpc.cli import app
from aihpc.perf.fit.runs_csv import template_text

RUNNER = CliRunner()


def _run(*args: str):
    return RUNNER.invoke(app, list(args))


def _one_line_exit_2(result, *words: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    for word in words:
        assert word in result.stderr, result.stderr


@pytest.fixture()
def template(tmp_path: Path) -> Path:
    out = _run("validate", "--runs-template")
    assert out.exit_code == 0
    path = tmp_path / "mine.csv"
    path.write_text(out.stdout)
    return path


def test_template_has_the_documented_columns_and_validates_alone(template: Path) -> None:
    """No memory CSV: the runs' own peak memory only, and no project target claimed."""
    rows = list(csv.DictReader(io.StringIO(template_text())))
    assert [r["id"] for r in rows] == ["llama8b-fsdp", "mcore-1.7b"]
    docs = (Path(__file__).parents[2] / "docs" / "performance-model.md").read_text()
    for column in rows[0]:
        assert f"`{column}`" in docs, column
    doc = json.loads(_run("validate", "--runs-template", "--json").stdout)
    assert doc["csv"] == template_text() and doc["columns"] == list(rows[0])
    r = _run("validate", "--runs", str(template), "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["user_runs"] is True and data["passed"] is None and data["targets"] is None
    assert [m["id"] for m in data["memory"]] == ["llama8b-fsdp"]
    assert data["memory_max_abs_error"] == {"peak_reserved": abs(data["memory"][0]["error"])}
    # the second row gives a step time: tokens/s/GPU = 192 x 4096 / 0.4519 s / 48 GPUs
    assert data["rows"][1]["measured_tokens_per_s_per_gpu"] == pytest.approx(
        192 * 4096 / 0.4519 / 48
    )
    text = _run("validate", "--runs", str(template)).stdout
    assert "Your runs: MAPE" in text and "Targets" not in text


@pytest.mark.parametrize(
    ("column", "value", "words"),
    [
        ("num_gpus", "8x", ("row llama8b-fsdp", "num_gpus", "'8x'", "whole number")),
        ("sequence_parallel", "yes", ("row llama8b-fsdp", "sequence_parallel", "true or false")),
        ("gpu", "h900", ("row llama8b-fsdp", "cluster.gpu", "h900")),
        ("measured_tokens_per_s_per_gpu", "-3", ("measured_tokens_per_s_per_gpu", "> 0")),
        ("id", "mcore-1.7b", ("id", "mcore-1.7b", "of its own")),
    ],
)
def test_bad_cell_is_one_line_naming_row_column_value(
    template: Path, column: str, value: str, words: tuple[str, ...]
) -> None:
    rows = list(csv.DictReader(io.StringIO(template.read_text())))
    rows[0][column] = value
    with open(template, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    _one_line_exit_2(_run("validate", "--runs", str(template)), *words)
    _one_line_exit_2(_run("calibrate", "--runs", str(template), "-O", "x.toml"), *words)


def test_calibrate_runs_writes_what_estimate_and_validate_use(
    template: Path, tmp_path: Path
) -> None:
    cal = tmp_path / "cal.toml"
    r = _run("calibrate", "--runs", str(template), "--fit", "gemm", "-O", str(cal), "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["fitted"] == ["gemm"] and out["num_runs"] == 2
    assert {"default_mape", "fitted_mape", "loo_mape"} <= set(out)
    assert [row["id"] for row in out["rows"]] == ["llama8b-fsdp", "mcore-1.7b"]
    table = tomllib.loads(cal.read_text())["efficiency"]
    assert table["gemm"] == pytest.approx(out["scales"]["gemm"]) and table["num_runs"] == 2
    assert table["attention"] == table["scale_up"] == table["scale_out"] == 1.0
    spec = tmp_path / "run.toml"
    spec.write_text(
        '[model]\npreset = "llama3-8b"\n[cluster]\ngpu = "h100-sxm"\nnum_gpus = 8\n'
        f'calibration = "{cal.name}"\n[parallel]\ntp = 1\npp = 1\nzero_stage = 1\n'
        'recompute = "selective"\nmicro_batch_size = 1\nglobal_batch_size = 32\n'
    )
    est = json.loads(_run("estimate", str(spec), "--json", "--no-goodput").stdout)
    assert est["calibration"]["efficiency"]["scales"]["gemm"] == out["scales"]["gemm"]
    assert "compute" in est["calibration"]["terms"]
    text = _run("estimate", str(spec), "--no-goodput").stdout
    assert "efficiency multipliers gemm x" in text and "fitted to 2 runs" in text
    v = json.loads(
        _run("validate", "--runs", str(template), "--calibration", str(cal), "--json").stdout
    )
    assert v["calibration"] == str(cal)
    # the first row's plan is complete, so validate prices it as the fit did
    assert v["rows"][0]["error"] == pytest.approx(out["rows"][0]["fitted_error"], rel=1e-9)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--runs", "RUNS", "--local"], ("--runs", "--local")),
        (["--runs", "RUNS", "--fit", "gemm,flops"], ("--fit", "gemm, attention")),
        (["--check", "RUNS"], ("--check", "only with --runs")),
        (["--runs", "missing.csv"], ("--runs", "file not found")),
    ],
)
def test_calibrate_runs_refuses_bad_flags(template: Path, args: list[str], words) -> None:
    args = [str(template) if a == "RUNS" else a for a in args]
    _one_line_exit_2(_run("calibrate", *args, "-O", "x.toml"), *words)
