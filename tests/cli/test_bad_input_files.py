"""Input files of the wrong shape: a calibration whose arrays are numbers or too short, a runs
CSV whose measured figure is 0, nan, inf or negative, or that is not UTF-8. Each was a
traceback (or a `MAPE nan%`) before; each must be exit 2 with one line naming the field."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aihpc.cli import app
from aihpc.perf.fit.validate import data_file

SPEC = """
[model]
preset = "llama3-8b"
[cluster]
gpu = "h100-sxm"
num_gpus = 8
gpus_per_node = 8
calibration = "cal.toml"
[parallel]
tp = 1
pp = 1
micro_batch_size = 1
global_batch_size = 8
"""
COMM = '[[comm]]\ncollective = "all_reduce"\ntier = "scale_up"\n'


def one_line_exit_2(result, field: str) -> None:
    assert result.exit_code == 2, result.output
    assert field in result.stderr and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ("comm = 5", "calibration.comm = 5"),
        (COMM + "regimes = 5", "calibration.comm[0].regimes = 5"),
        (COMM + "regimes = [5]", "calibration.comm[0].regimes[0]"),
        ("gemm = 5", "calibration.gemm = 5"),
        ("[[gemm]]\npoints = 5", "calibration.gemm[0].points = 5"),
        ("[[gemm]]\npoints = [[1.0]]", "calibration.gemm[0].points = [1.0]"),
        ("[[gemm]]\npoints = [1, 2]", "calibration.gemm[0].points = 1"),
    ],
)
def test_calibration_of_the_wrong_shape_is_one_line(tmp_path: Path, body: str, field: str) -> None:
    (tmp_path / "cal.toml").write_text(body + "\n")
    spec = tmp_path / "run.toml"
    spec.write_text(SPEC)
    one_line_exit_2(CliRunner().invoke(app, ["estimate", str(spec)]), field)


def _runs_csv(path: Path, measured: str) -> Path:
    with open(data_file("published_runs.csv"), newline="") as fh:
        reader = csv.DictReader(fh)
        row = next(reader)
        columns = reader.fieldnames
    row["measured_tokens_per_s_per_gpu"] = measured
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerow(row)
    return path


@pytest.mark.parametrize("measured", ["0", "nan", "inf", "-1", "fast"])
def test_validate_refuses_a_measured_figure_that_is_not_positive(
    tmp_path: Path, measured: str
) -> None:
    runs = _runs_csv(tmp_path / "runs.csv", measured)
    result = CliRunner().invoke(app, ["validate", "--runs", str(runs)])
    one_line_exit_2(result, "measured_tokens_per_s_per_gpu")
    assert "finite number > 0" in result.stderr


def test_validate_names_a_csv_that_is_not_utf8(tmp_path: Path) -> None:
    runs = tmp_path / "runs.csv"
    runs.write_bytes(b"id,source\n\xff\xfe\x80 not text\n")
    one_line_exit_2(CliRunner().invoke(app, ["validate", "--runs", str(runs)]), "not UTF-8")
