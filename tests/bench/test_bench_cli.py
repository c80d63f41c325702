"""aihpc bench comm / gemm through the command line: JSON, table, exit codes, calibrate."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from typer.testing import CliRunner

from aihpc.cli import app
from aihpc.spec.calibration import load_calibration


def _cli(*args, cwd=None, timeout=180):
    return subprocess.run(
        [sys.executable, "-m", "aihpc", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
    )


def test_comm_json_then_calibrate(tmp_path):
    res = _cli(
        "bench",
        "comm",
        "--nproc-per-node",
        "2",
        "-C",
        "all_reduce,all_gather",
        "-b",
        "1K",
        "-e",
        "64K",
        "-f",
        "4",
        "-n",
        "3",
        "--json",
        "--output",
        str(tmp_path / "comm.json"),
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["benchmark"] == "comm" and doc["world_size"] == 2 and doc["wrong_rows"] == 0
    rows = doc["results"]
    assert len(rows) == 8  # 2 collectives x 4 sizes, one object per size and collective
    for r in rows:
        assert {"size_bytes", "time_us", "algbw_GBps", "busbw_GBps", "wrong"} <= set(r)
        assert r["wrong"] == 0 and r["in_place"]["wrong"] == 0
        factor = 1.0 if r["collective"] == "all_reduce" else 0.5
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * factor)
    assert json.loads((tmp_path / "comm.json").read_text()) == doc
    out = tmp_path / "cal.toml"
    res = _cli("calibrate", str(tmp_path / "comm.json"), "-O", str(out), "--regimes", "2")
    assert res.returncode == 0, res.stderr
    cal = load_calibration(out)
    for coll in ("all_reduce", "all_gather"):
        fit = cal.comm_fit(coll, "scale_up")
        assert fit is not None and fit.num_ranks == 2 and fit.num_points == 4
        assert len(fit.regimes) == 1  # 4 sizes: too few for two regimes of >= 3 points


def test_comm_table_is_nccl_tests_layout():
    res = _cli(
        "bench",
        "comm",
        "--nproc-per-node",
        "2",
        "-C",
        "broadcast",
        "-b",
        "4K",
        "-e",
        "4K",
        "-n",
        "2",
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("# Collective test starting: broadcast_perf")
    assert sum(line.startswith("#  Rank") for line in lines) == 2
    assert any(line.split()[1:3] == ["size", "count"] for line in lines)
    (row,) = [line for line in lines if line and not line.startswith("#")]
    tok = row.split()
    assert tok[:5] == ["4096", "1024", "float", "none", "0"] and tok[8] == "0"
    assert any(line.startswith("# Avg bus bandwidth    :") for line in lines)
    # our own parser reads our own output back
    from aihpc.bench.nccl_log import parse_nccl_tests

    (t,) = parse_nccl_tests(lines)
    assert t.collective == "broadcast" and t.num_ranks == 2 and len(t.rows) == 1


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["-C", "allreduce"], "--collective"),
        (["-d", "float8"], "-d/--datatype"),
        (["-b", "1M", "-e", "1K"], "-b/--minbytes"),
        (["-o", "xor"], "-o/--op"),
        (["--group", "rack"], "--group"),
        (["-n", "0"], "-n/--iters"),
        (["-c", "3"], "-c/--check"),
        (["--nproc-per-node", "3", "--ranks-per-node", "2"], "--ranks-per-node"),
        (["--nproc-per-node", "1", "-C", "send_recv"], "send_recv"),
        (["-o", "avg", "-d", "int32"], "-o/--op"),
    ],
)
def test_comm_bad_input_exit_2(args, needle):
    # in-process: bad input is refused before any worker starts
    res = CliRunner().invoke(app, ["bench", "comm", *args])
    assert res.exit_code == 2, res.output
    assert needle in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_inter_group_on_one_node_is_exit_2():
    res = _cli("bench", "comm", "--nproc-per-node", "2", "--group", "inter", "-b", "1K", "-e", "1K")
    assert res.returncode == 2
    assert "--group" in res.stderr and "Traceback" not in res.stderr


def test_gemm_cli_and_calibrate(tmp_path):
    res = _cli(
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
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert [(r["m"], r["n"], r["k"]) for r in doc["results"]] == [(64, 64, 64), (128, 256, 64)]
    for r in doc["results"]:
        assert r["gflop"] == pytest.approx(2 * r["m"] * r["n"] * r["k"] / 1e9)
        assert r["tflops"] == pytest.approx(r["gflop"] / 1e3 / (r["time_us"] * 1e-6))
    res = _cli("calibrate", str(tmp_path / "gemm.json"), "-O", str(tmp_path / "g.toml"))
    assert res.returncode == 0, res.stderr
    g = load_calibration(tmp_path / "g.toml").gemm["fp32"]
    assert [p[0] for p in g.points] == pytest.approx([0.000524288, 0.004194304])
    res = CliRunner().invoke(app, ["bench", "gemm", "-p", "fp4"])
    assert res.exit_code == 2 and "--precision" in res.stderr
    res = CliRunner().invoke(app, ["bench", "gemm", "-s", "12x0x4"])
    assert res.exit_code == 2 and "--shape" in res.stderr
