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
    _one_line_exit_2(_run("calibrate", "--runs", str(template), "-o", "x.toml"), *words)


def test_calibrate_runs_writes_what_estimate_and_validate_use(
    template: Path, tmp_path: Path
) -> None:
    cal = tmp_path / "cal.toml"
    r = _run("calibrate", "--runs", str(template), "--fit", "gemm", "-o", str(cal), "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["fitted"] == ["gemm"] and out["num_runs"] == 2
    assert {"default_mape", "fitted_mape", "loo_mape"} <= set(out)
    # the template's two runs: the fit to one prices the other worse than the defaults do
    assert out["loo_beats_default"] is (out["loo_mape"] < out["default_mape"]) is False
    assert len(out["warnings"]) == 1 and "out of sample" in r.stderr
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
    _one_line_exit_2(_run("calibrate", *args, "-o", "x.toml"), *words)


def _published(tmp_path: Path, name: str, ids: tuple[str, ...]) -> Path:
    """A runs CSV of the published rows ``ids`` (the runs CSV reads the published columns)."""
    from aihpc.perf.fit.validate import data_file

    with open(data_file("published_runs.csv"), newline="") as fh:
        reader = csv.DictReader(fh)
        rows = [r for r in reader if r["id"] in ids]
        columns = reader.fieldnames
    path = tmp_path / name
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_calibrate_runs_warns_when_the_fit_loses_out_of_sample(tmp_path: Path) -> None:
    """Four runs of two clusters and three multipliers: the fit lowers its own error, but each
    run priced by a fit to the other three is further off than at the default constants. The
    calibration is written (asked for), with the warning on stderr, in --json and in the file."""
    runs = _published(tmp_path, "few.csv", ("A03", "B02", "B08", "A14"))
    cal = tmp_path / "few-cal.toml"
    r = _run("calibrate", "--runs", str(runs), "-o", str(cal), "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert len(out["fitted"]) == 3 and out["num_runs"] == 4
    assert out["fitted_mape"] < out["default_mape"] <= out["loo_mape"]
    assert out["loo_beats_default"] is False
    [warning] = out["warnings"]
    for figure in (out["loo_mape"], out["default_mape"]):
        assert f"{figure:.1%}" in warning
    assert "warning: the fit does not beat the default constants out of sample" in r.stderr
    assert f"leave-one-out MAPE {out['loo_mape']:.1%}" in r.stderr
    text = cal.read_text()
    assert f"# WARNING: {warning}" in text
    assert tomllib.loads(text)["efficiency"]["loo_mape"] == pytest.approx(out["loo_mape"])
    # the table's output ends with the warning, after the line saying what was written
    table = _run("calibrate", "--runs", str(runs), "-o", str(cal))
    assert table.exit_code == 0 and "wrote" in table.stdout
    assert table.stderr.strip().splitlines()[-1].startswith("warning: the fit does not beat")


def test_calibrate_runs_is_quiet_when_the_fit_helps_out_of_sample(tmp_path: Path) -> None:
    """Megatron-Core's nine rows and the GEMM multiplier: leave-one-out well under the
    defaults' error (docs/performance-model.md), so no warning anywhere."""
    runs = _published(tmp_path, "mcore.csv", tuple(f"D0{i}" for i in range(1, 10)))
    cal = tmp_path / "mcore-cal.toml"
    r = _run("calibrate", "--runs", str(runs), "--fit", "gemm", "-o", str(cal), "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["num_runs"] == 9 and out["loo_mape"] < out["default_mape"]
    assert out["loo_beats_default"] is True and out["warnings"] == []
    assert "warning" not in r.stderr and "WARNING" not in cal.read_text()


def test_check_set_no_better_than_the_defaults_is_warned(tmp_path: Path) -> None:
    """The four-run fit carried to Megatron-Core's rows prices them worse than the defaults."""
    runs = _published(tmp_path, "few.csv", ("A03", "B02", "B08", "A14"))
    check = _published(tmp_path, "mcore.csv", tuple(f"D0{i}" for i in range(1, 10)))
    cal = str(tmp_path / "x.toml")
    r = _run("calibrate", "--runs", str(runs), "--check", str(check), "-o", cal, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["check"]["calibrated_mape"] >= out["check"]["default_mape"]
    assert len(out["warnings"]) == 2 and out["warnings"][1].startswith("on the --check runs")
