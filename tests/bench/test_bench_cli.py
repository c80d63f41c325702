"""aihpc bench comm / gemm through the command line: JSON, table, exit codes, calibrate."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from typer.testing import CliRunner

from aihpc.cli import app
from aihpc.runspec.calibration import load_calibration


def _cli(*args, cwd=None, timeout=180):
    return subprocess.run(
        [sys.executable, "-m", "aihpc", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
    )


def test_comm_table_json_file_then_calibrate(tmp_path):
    """One launch of two workers (they cost most of this test): nccl-tests' table on stdout, the
    same results as JSON in --output, and the JSON calibrated. (--json on stdout: the torchrun
    test in test_launchers.py.)"""
    res = _cli(
        "bench",
        "comm",
        "--nproc-per-node",
        "2",
        "-C",
        "all_reduce,all_gather,broadcast",
        "-b",
        "1K",
        "-e",
        "64K",
        "-f",
        "4",
        "-n",
        "3",
        "--output",
        str(tmp_path / "comm.json"),
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("# Collective test starting: all_reduce_perf")
    assert sum(line.startswith("#  Rank") for line in lines) == 3 * 2  # 2 ranks per collective
    assert any(line.split()[1:3] == ["size", "count"] for line in lines)
    rows = [line.split() for line in lines if line and not line.startswith("#")]
    assert len(rows) == 12  # 3 collectives x 4 sizes
    assert rows[8][:5] == ["1024", "256", "float", "none", "0"]  # broadcast: no redop, root 0
    assert all(r[8] == "0" and r[12] == "0" for r in rows)  # #wrong, out-of-place and in-place
    assert sum(line.startswith("# Avg bus bandwidth    :") for line in lines) == 3
    # our own parser reads our own output back
    from aihpc.bench.nccl_log import parse_nccl_tests

    tests = parse_nccl_tests(lines)
    assert [t.collective for t in tests] == ["all_reduce", "all_gather", "broadcast"]
    assert all(t.num_ranks == 2 and len(t.rows) == 4 for t in tests)
    doc = json.loads((tmp_path / "comm.json").read_text())
    assert doc["benchmark"] == "comm" and doc["world_size"] == 2 and doc["wrong_rows"] == 0
    results = doc["results"]
    assert len(results) == 12  # one object per size and collective
    for r, row in zip(results, rows, strict=True):
        assert {"size_bytes", "time_us", "algbw_GBps", "busbw_GBps", "wrong"} <= set(r)
        assert r["wrong"] == 0 and r["in_place"]["wrong"] == 0
        factor = {"all_reduce": 1.0, "all_gather": 0.5, "broadcast": 1.0}[r["collective"]]
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * factor)
        # the table and the file are one measurement: the table's time is the file's, rounded to
        # the decimals nccl-tests' fixed-width column leaves (2, 1 or 0; half a last digit apart)
        decimals = len(row[5].partition(".")[2]) if "e" not in row[5] else 0
        half_digit = 0.5 * 10.0**-decimals if "e" not in row[5] else 0.05 * float(row[5])
        assert int(row[0]) == r["size_bytes"]
        assert abs(float(row[5]) - r["time_us"]) <= half_digit * (1 + 1e-9), (row[5], r["time_us"])
    out = tmp_path / "cal.toml"
    res = _cli("calibrate", str(tmp_path / "comm.json"), "-o", str(out), "--regimes", "2")
    assert res.returncode == 0, res.stderr
    cal = load_calibration(out)
    for coll in ("all_reduce", "all_gather", "broadcast"):
        fit = cal.comm_fit(coll, "scale_up")
        assert fit is not None and fit.num_ranks == 2 and fit.num_points == 4
        assert len(fit.regimes) == 1  # 4 sizes: too few for two regimes of >= 3 points


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["-C", "allreduce"], "--collective"),
        (["-d", "float8"], "-d/--datatype"),
        (["-b", "1M", "-e", "1K"], "-b/--minbytes"),
        (["--op", "xor"], "--op"),
        (["--group", "rack"], "--group"),
        (["-n", "0"], "-n/--iters"),
        (["-c", "3"], "-c/--check"),
        (["--nproc-per-node", "3", "--ranks-per-node", "2"], "--ranks-per-node"),
        (["--nproc-per-node", "1", "-C", "send_recv"], "send_recv"),
        (["--op", "avg", "-d", "int32"], "--op"),
        (["--nproc-per-node", "2", "--group", "inter", "-b", "1K", "-e", "1K"], "--group"),
    ],
)
def test_comm_bad_input_exit_2(args, needle):
    # in-process: bad input is refused before any worker starts
    res = CliRunner().invoke(app, ["bench", "comm", *args])
    assert res.exit_code == 2, res.output
    assert needle in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_gemm_cli_and_calibrate(tmp_path):
    # in-process: bench gemm starts no worker
    res = CliRunner().invoke(
        app,
        [
            "bench",
            "gemm",
            "-s",
            "64",
            "-s",
            "128x256x64",
            "-p",
            "fp32",
            "-n",
            "2",
            "--json",
            "--output",
            str(tmp_path / "gemm.json"),
        ],
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert [(r["m"], r["n"], r["k"]) for r in doc["results"]] == [(64, 64, 64), (128, 256, 64)]
    for r in doc["results"]:
        assert r["gflop"] == pytest.approx(2 * r["m"] * r["n"] * r["k"] / 1e9)
        assert r["tflops"] == pytest.approx(r["gflop"] / 1e3 / (r["time_us"] * 1e-6))
    res = CliRunner().invoke(
        app, ["calibrate", str(tmp_path / "gemm.json"), "-o", str(tmp_path / "g.toml")]
    )
    assert res.exit_code == 0, res.output
    g = load_calibration(tmp_path / "g.toml").gemm["fp32"]
    assert [p[0] for p in g.points] == pytest.approx([0.000524288, 0.004194304])
    res = CliRunner().invoke(app, ["bench", "gemm", "-p", "fp4"])
    assert res.exit_code == 2 and "--precision" in res.stderr
    res = CliRunner().invoke(app, ["bench", "gemm", "-s", "12x0x4"])
    assert res.exit_code == 2 and "--shape" in res.stderr
