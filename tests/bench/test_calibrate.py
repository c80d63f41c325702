"""Fitting recovers known parameters; the calibration file round-trips; aihpc calibrate."""

from __future__ import annotations

import json
import math
import os
import random
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from aihpc.bench.calibrate import CommPoint, fit_comm, fit_regime
from aihpc.bench.collectives import busbw_factor
from aihpc.runspec.calibration import (
    calibration_from_dict,
    calibration_to_toml,
    load_calibration,
)
from aihpc.runspec.errors import SpecError

DATA = Path(__file__).parent / "data"


def _synthetic(regimes, n=8, coll="all_reduce", noise=0.0, seed=0):
    """Times from known (max_bytes, latency_us, busbw_GBps) regimes, log-spaced sizes."""
    rng = random.Random(seed)
    f = busbw_factor(coll, n)
    pts = []
    for s in [2**k for k in range(10, 34)]:
        lat, bw = next((lat, bw) for mb, lat, bw in regimes if s <= mb)
        t = (lat + s * f / (bw * 1e3)) * (1 + rng.uniform(-noise, noise))
        pts.append(CommPoint(coll, "scale_up", n, float(s), t))
    return pts


def test_fit_regime_exact_on_a_line():
    f = busbw_factor("all_gather", 4)
    sizes = [2.0**k for k in range(16, 28)]
    times = [12.5 + s * f / (200.0 * 1e3) for s in sizes]
    lat, bw = fit_regime(sizes, times, f)
    assert lat == pytest.approx(12.5, rel=1e-9)
    assert bw == pytest.approx(200.0, rel=1e-9)


def test_fit_regime_keeps_latency_non_negative():
    # a pure-bandwidth series with noise would give a slightly negative intercept
    f = 1.0
    sizes = [2.0**k for k in range(20, 30)]
    times = [s / 1e5 * (1 + 0.01 * (-1) ** i) for i, s in enumerate(sizes)]
    lat, bw = fit_regime(sizes, times, f)
    assert lat >= 0 and bw == pytest.approx(100.0, rel=0.02)


@pytest.mark.parametrize("noise", [0.0, 0.01])
def test_two_regimes_recovered(noise):
    truth = [(2**21, 25.0, 110.0), (math.inf, 60.0, 470.0)]
    rep = fit_comm(_synthetic(truth, noise=noise), num_regimes=2)
    (r1, r2) = rep.fit.regimes
    tol = 1e-3 if noise == 0 else 0.06
    assert r1.latency_us == pytest.approx(25.0, rel=tol)
    assert r1.busbw_GBps == pytest.approx(110.0, rel=tol)
    assert r2.busbw_GBps == pytest.approx(470.0, rel=tol)
    assert r2.latency_us == pytest.approx(60.0, rel=0.3 if noise else tol)
    # the breakpoint lies between the last size of regime 1 and the first of regime 2
    assert 2**21 <= r1.max_bytes < 2**22
    assert rep.max_rel_error <= noise * 2.5 + 1e-6
    # one line cannot follow a protocol switch: its error is far larger
    assert rep.single_regime_max_rel_error > 0.2


def test_three_regimes_recovered():
    truth = [(2**18, 8.0, 20.0), (2**25, 30.0, 150.0), (math.inf, 200.0, 480.0)]
    rep = fit_comm(_synthetic(truth, coll="reduce_scatter"), num_regimes=3)
    got = [(r.latency_us, r.busbw_GBps) for r in rep.fit.regimes]
    for (lat, bw), (_, t_lat, t_bw) in zip(got, truth, strict=True):
        assert lat == pytest.approx(t_lat, rel=1e-3)
        assert bw == pytest.approx(t_bw, rel=1e-3)
    assert rep.max_rel_error < 1e-3


def test_fit_of_real_format_sample_beats_one_line():
    from aihpc.bench.calibrate import points_from_nccl_tests
    from aihpc.bench.nccl_log import read_nccl_tests_log

    pts = points_from_nccl_tests(read_nccl_tests_log(DATA / "all_reduce_perf_8xH100_1node.txt"))
    rep = fit_comm(pts, num_regimes=3)
    assert rep.num_ranks == 8 and rep.fit.tier == "scale_up"
    assert rep.max_rel_error < 0.12 < rep.single_regime_max_rel_error
    # large-message busbw of NVLS all_reduce on 8x H100 is ~480 GB/s (Azure ND H100 v5)
    assert 460 < rep.fit.regimes[-1].busbw_GBps < 500
    # the model reproduces every measured time within the reported error
    f = busbw_factor("all_reduce", 8)
    for p in pts:
        r = rep.fit.regime(p.size_bytes)
        pred = r.latency_us + p.size_bytes * f / (r.busbw_GBps * 1e3)
        assert abs(pred - p.time_us) / p.time_us <= rep.max_rel_error + 1e-9


def test_toml_round_trip_and_strict_keys():
    rep = fit_comm(_synthetic([(2**21, 25.0, 110.0), (math.inf, 60.0, 470.0)]), 2)
    from aihpc.runspec.calibration import Calibration, GemmFit

    cal = Calibration(
        comm={("all_reduce", "scale_up"): rep.fit},
        gemm={"bf16": GemmFit("bf16", ((0.5, 310.0), (137.4, 720.0)))},
        source='test "quoted"',
    )
    text = calibration_to_toml(cal, "header line")
    back = calibration_from_dict(tomllib.loads(text))
    assert back.comm == cal.comm and back.gemm == cal.gemm and back.source == cal.source
    data = tomllib.loads(text)
    data["comm"][0]["regimes"][0]["busbw_gbps"] = 1.0
    with pytest.raises(SpecError, match="busbw_gbps"):
        calibration_from_dict(data)


@pytest.mark.parametrize(
    ("key", "value"),
    [("busbw_GBps", math.nan), ("busbw_GBps", math.inf), ("latency_us", math.nan)],
)
def test_calibration_refuses_non_finite_figures(key: str, value: float) -> None:
    """A nan bandwidth would price every collective as nan, an infinite one as free; only a
    regime's upper size bound may be inf (no bound)."""
    data = {
        "comm": [
            {
                "collective": "all_reduce",
                "tier": "scale_up",
                "regimes": [{"latency_us": 20.0, "busbw_GBps": 300.0, "max_bytes": math.inf}],
            }
        ]
    }
    assert calibration_from_dict(data).comm_fit("all_reduce", "scale_up") is not None
    data["comm"][0]["regimes"][0][key] = value
    with pytest.raises(SpecError, match=key):
        calibration_from_dict(data)


def _cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "aihpc", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


def test_calibrate_cli_from_nccl_tests_logs(tmp_path):
    out = tmp_path / "cal.toml"
    logs = [
        DATA / n
        for n in (
            "all_reduce_perf_8xH100_1node.txt",
            "all_reduce_perf_2x8xH100_ib.txt",
            "all_gather_perf_2x8xH100_ib.txt",
        )
    ]
    res = _cli("calibrate", *map(str, logs), "-o", str(out), "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    keys = {(c["collective"], c["tier"], c["num_ranks"]) for c in summary["comm"]}
    assert keys == {
        ("all_reduce", "scale_up", 8),
        ("all_reduce", "scale_out", 16),
        ("all_gather", "scale_out", 16),
    }
    cal = load_calibration(out)
    fit = cal.comm_fit("all_reduce", "scale_out")
    assert fit is not None and len(fit.regimes) == 3 and fit.max_rel_error < 0.15
    assert 340 < fit.regime(8e9).busbw_GBps < 380


def test_calibrate_from_nccl_tests_json_equals_text(tmp_path):
    from aihpc.bench.calibrate import fit_to_calibration, load_measurements

    fits = []
    for name in ("all_reduce_perf_8xH100_1node.json", "all_reduce_perf_8xH100_1node.txt"):
        comm, gemm = load_measurements([DATA / name])
        cal, _ = fit_to_calibration(comm, gemm, name)
        fits.append(cal.comm_fit("all_reduce", "scale_up"))
    for a, b in zip(fits[0].regimes, fits[1].regimes, strict=True):
        assert a.max_bytes == b.max_bytes
        assert a.busbw_GBps == pytest.approx(b.busbw_GBps, rel=1e-3)
        assert a.latency_us == pytest.approx(b.latency_us, rel=1e-2)


def test_calibrate_cli_needs_no_torch(tmp_path):
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any import of torch now fails
        "from aihpc.cli import main; sys.argv = ['aihpc', 'calibrate', sys.argv[1], '-O', "
        "sys.argv[2]]\nmain()"
    )
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            str(DATA / "all_reduce_perf_8xH100_1node.txt"),
            str(tmp_path / "c.toml"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert load_calibration(tmp_path / "c.toml").comm_fit("all_reduce", "scale_up")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["missing.txt"], "cannot be read"),
        (["empty.txt"], "no nccl-tests data rows"),
        (["bad.json"], "not valid JSON"),
        (["all_reduce_perf_8xH100_1node.txt", "--tier", "scale_sideways"], "--tier"),
        (["all_reduce_perf_8xH100_1node.txt", "--regimes", "9"], "--regimes"),
        (["all_reduce_perf_8xH100_1node.txt", "--collective", "allreduce"], "--collective"),
    ],
)
def test_calibrate_cli_bad_input_exit_2(tmp_path, monkeypatch, args, needle):
    from typer.testing import CliRunner

    from aihpc.cli import app

    (tmp_path / "empty.txt").write_text("nothing here\n")
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "all_reduce_perf_8xH100_1node.txt").write_text(
        (DATA / "all_reduce_perf_8xH100_1node.txt").read_text()
    )
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["calibrate", *args, "-o", "out.toml"])
    assert res.exit_code == 2, res.output
    assert needle in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out.toml").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.toml")]


def test_calibrate_output_path(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from aihpc.cli import app

    log = str(DATA / "all_reduce_perf_8xH100_1node.txt")
    monkeypatch.chdir(tmp_path)
    # a folder in the way: one line, exit 2, nothing left behind
    (tmp_path / "taken").mkdir()
    res = CliRunner().invoke(app, ["calibrate", log, "-o", "taken"])
    assert res.exit_code == 2 and "--output" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
    # a folder that does not exist is not created (a typo would hide the file): one line, exit 2
    res = CliRunner().invoke(app, ["calibrate", log, "-o", "new/cal.toml"])
    assert res.exit_code == 2 and "folder 'new' does not exist" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
    # the file written is readable by others as open() would make it (umask 022: 0644), not
    # the temporary file's owner-only 0600
    (tmp_path / "new").mkdir()
    old = os.umask(0o022)
    try:
        res = CliRunner().invoke(app, ["calibrate", log, "-o", "new/cal.toml"])
    finally:
        os.umask(old)
    assert res.exit_code == 0, res.output
    assert stat.S_IMODE((tmp_path / "new" / "cal.toml").stat().st_mode) == 0o644
    assert load_calibration(tmp_path / "new" / "cal.toml").comm_fit("all_reduce", "scale_up")
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["cal.toml"]


def test_synthetic_noise_is_not_hidden():
    # regression guard: a fit that ignored the data would report zero error on noisy input
    pts = _synthetic([(math.inf, 10.0, 100.0)], noise=0.05, seed=3)
    rep = fit_comm(pts, num_regimes=1)
    errs = []
    for p in pts:
        r = rep.fit.regime(p.size_bytes)
        errs.append(
            abs(r.latency_us + p.size_bytes * 1.75 / (r.busbw_GBps * 1e3) - p.time_us) / p.time_us
        )
    assert rep.max_rel_error == pytest.approx(float(np.max(errs)), abs=1e-4)
    assert rep.max_rel_error > 0.02


def test_shipped_example_is_what_calibrate_produces():
    from aihpc.bench.calibrate import fit_to_calibration, load_measurements

    root = Path(__file__).parents[2]
    logs = [
        DATA / n
        for n in (
            "all_reduce_perf_8xH100_1node.txt",
            "all_reduce_perf_2x8xH100_ib.txt",
            "all_gather_perf_2x8xH100_ib.txt",
        )
    ]
    comm, gemm = load_measurements(logs)
    cal, _ = fit_to_calibration(comm, gemm, "x")
    assert load_calibration(root / "examples" / "calibration-h100.toml").comm == cal.comm


def test_calibrate_records_ranks_per_node_from_log_hosts() -> None:
    from aihpc.bench.calibrate import fit_to_calibration, load_measurements

    data = Path(__file__).resolve().parent / "data"
    comm, gemm = load_measurements([data / "all_reduce_perf_2x8xH100_ib.txt"])
    cal, _ = fit_to_calibration(comm, gemm, "x")
    assert cal.comm_fit("all_reduce", "scale_out").ranks_per_domain == 8


def _flat_then_linear() -> list[CommPoint]:
    """Sizes up to 64 KiB all take 30 us (latency-bound: no bandwidth can be read from them),
    then 20 us + bytes at 400 GB/s busbw."""
    f = busbw_factor("all_reduce", 8)
    sizes = [2.0**k for k in range(10, 28)]
    return [
        CommPoint("all_reduce", "scale_up", 8, s, 30.0 if s <= 65536 else 20.0 + s * f / 400e3)
        for s in sizes
    ]


def test_latency_bound_regime_gets_the_measured_busbw_not_an_absurd_one():
    rep = fit_comm(_flat_then_linear(), num_regimes=2)
    small, large = rep.fit.regimes
    # the free fit of the flat sizes has no bandwidth term (it once wrote 1e6 GB/s)
    ((index, fitted),) = rep.capped
    assert index == 0 and fitted > 1e4
    # replaced by the best busbw any size reached, with the latency fitted again
    assert small.busbw_GBps == pytest.approx(rep.best_measured_busbw_GBps, rel=1e-5)
    assert small.latency_us == pytest.approx(30.0, rel=0.01)
    assert large.busbw_GBps == pytest.approx(400.0, rel=1e-3) and rep.max_rel_error < 0.01


def test_calibrate_says_which_regime_it_capped(tmp_path):
    from typer.testing import CliRunner

    from aihpc.cli import app

    doc = {
        "benchmark": "comm",
        "results": [
            {
                "collective": p.collective,
                "tier": p.tier,
                "num_ranks": p.num_ranks,
                "size_bytes": p.size_bytes,
                "time_us": p.time_us,
            }
            for p in _flat_then_linear()
        ],
    }
    (tmp_path / "bench.json").write_text(json.dumps(doc))
    args = ["calibrate", str(tmp_path / "bench.json"), "-o", str(tmp_path / "cal.toml")]
    res = CliRunner().invoke(app, [*args, "--regimes", "2"])
    assert res.exit_code == 0, res.output
    assert "regime 1: its sizes fit a busbw of" in res.stderr and "best measured" in res.stderr
    assert "*" in next(x for x in res.stdout.splitlines() if "all_reduce" in x)
    out = json.loads(CliRunner().invoke(app, [*args, "--regimes", "2", "--json"]).stdout)
    small = out["comm"][0]["regimes"][0]
    assert small["fitted_busbw_GBps"] > 1e4 and small["busbw_GBps"] < 500
    cal = load_calibration(tmp_path / "cal.toml")
    assert max(r.busbw_GBps for r in cal.comm_fit("all_reduce", "scale_up").regimes) < 500
