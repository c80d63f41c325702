"""End to end: nccl-tests logs -> aihpc calibrate -> [cluster] calibration -> aihpc estimate."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aihpc.cli import app
from aihpc.runspec.calibration import Calibration, calibration_to_toml, load_calibration

DATA = Path(__file__).parent / "data"
RUN = """
[model]
preset = "llama3-70b"
[cluster]
gpu = "h100-sxm"
num_gpus = 64
gpus_per_node = 8
{calibration}
[parallel]
tp = 8
pp = 2
dp = 4
sequence_parallel = false
zero_stage = 0
recompute = "full"
micro_batch_size = 1
global_batch_size = 32
[training]
precision = "bf16"
"""


def _estimate(path: Path) -> dict:
    res = CliRunner().invoke(app, ["estimate", str(path), "--json"])
    out = json.loads(res.stdout)
    assert res.exit_code == (0 if out["fits"] else 1), res.output  # 1: the plan does not fit
    return out


def _scaled(cal: Calibration, k: float) -> Calibration:
    comm = {
        key: dataclasses.replace(
            f, regimes=tuple(dataclasses.replace(r, busbw_GBps=r.busbw_GBps * k) for r in f.regimes)
        )
        for key, f in cal.comm.items()
    }
    return Calibration(comm=comm, source=f"x{k}")


def test_calibrated_bandwidth_drives_estimate(tmp_path):
    logs = [
        str(DATA / "all_reduce_perf_8xH100_1node.txt"),
        str(DATA / "all_reduce_perf_2x8xH100_ib.txt"),
    ]
    res = CliRunner().invoke(app, ["calibrate", *logs, "-o", str(tmp_path / "cal.toml")])
    assert res.exit_code == 0, res.output
    cal = load_calibration(tmp_path / "cal.toml")
    (tmp_path / "half.toml").write_text(calibration_to_toml(_scaled(cal, 0.5)))
    for name, line in [
        ("none", ""),
        ("cal", 'calibration = "cal.toml"'),
        ("half", 'calibration = "half.toml"'),
    ]:
        (tmp_path / f"run_{name}.toml").write_text(RUN.format(calibration=line))
    none, full, half = (
        _estimate(tmp_path / f"run_{n}.toml")["time_s"] for n in ("none", "cal", "half")
    )
    # TP (8 ranks, one node) all-reduces use the scale_up fit: halving its busbw must slow them
    # by more than nothing and at most 2x (latency does not change)
    assert full["tp_comm"] != pytest.approx(none["tp_comm"], rel=1e-3)
    assert 1.2 < half["tp_comm"] / full["tp_comm"] <= 2.0
    # compute does not depend on the network
    assert half["compute"] == pytest.approx(full["compute"], rel=0.01)


def _calibrate(tmp_path: Path, log: str, name: str) -> None:
    res = CliRunner().invoke(app, ["calibrate", str(DATA / log), "-o", str(tmp_path / name)])
    assert res.exit_code == 0, res.output


def test_estimate_says_what_the_calibration_covered_and_changed(tmp_path):
    """One node's all-reduce fit: the plan's tensor-parallel all-reduces (8 ranks in a node, no
    sequence parallelism) use it, its data-parallel all-reduce across nodes does not."""
    _calibrate(tmp_path, "all_reduce_perf_8xH100_1node.txt", "cal.toml")
    (tmp_path / "run.toml").write_text(RUN.format(calibration='calibration = "cal.toml"'))
    (tmp_path / "none.toml").write_text(RUN.format(calibration=""))
    out, none = _estimate(tmp_path / "run.toml"), _estimate(tmp_path / "none.toml")
    use = out["calibration"]
    assert none["calibration"] is None
    assert use["path"] == str(tmp_path / "cal.toml")
    assert use["covers"] == [{"collective": "all_reduce", "tier": "scale_up"}]
    assert {"collective": "all_reduce", "tier": "scale_up"} in use["used"]
    assert {"collective": "all_reduce", "tier": "scale_out"} in use["not_covered"]
    # the terms it names are exactly those that differ from the estimate without the file
    changed = [k for k, v in out["time_s"].items() if v != pytest.approx(none["time_s"][k])]
    assert sorted(use["terms"]) == sorted(changed) and "tp_comm" in changed
    assert "dp_comm" not in changed and use["warnings"] == []
    res = CliRunner().invoke(app, ["estimate", str(tmp_path / "run.toml")])
    lines = res.stdout.splitlines()
    assert any(x.startswith("calibration: ") and "all_reduce/scale_up" in x for x in lines)
    tp_row = next(x for x in lines if x.strip().startswith("tensor-parallel comm"))
    dp_row = next(x for x in lines if x.strip().startswith("data-parallel comm"))
    assert tp_row.split()[-1] == "yes" and dp_row.split()[-1] != "yes"


def test_a_calibration_the_plan_never_uses_is_a_warning(tmp_path):
    """A multi-node all-gather fit priced into a one-node plan covers nothing it uses."""
    _calibrate(tmp_path, "all_gather_perf_2x8xH100_ib.txt", "ib.toml")
    run = RUN.format(calibration='calibration = "ib.toml"').replace("num_gpus = 64", "num_gpus = 8")
    (tmp_path / "run.toml").write_text(run.replace("dp = 4", "dp = 1").replace("pp = 2", "pp = 1"))
    res = CliRunner().invoke(app, ["estimate", str(tmp_path / "run.toml"), "--json"])
    out = json.loads(res.stdout)
    assert out["calibration"]["used"] == [] and out["calibration"]["terms"] == []
    warning = out["calibration"]["warnings"][0]
    assert "covers none of the collectives this plan uses" in warning
    assert "warning: " in res.stderr and "all_reduce/scale_up" in res.stderr


def test_an_impossible_busbw_is_flagged(tmp_path):
    """A regime of 1e6 GB/s (what a latency-only fit once wrote) is named, not silently used."""
    (tmp_path / "cal.toml").write_text(
        'source = "hand"\n[[comm]]\ncollective = "all_reduce"\ntier = "scale_up"\n'
        "num_ranks = 8\nregimes = [\n  { max_bytes = 65536.0, latency_us = 20.0, busbw_GBps = "
        "1000000.0 },\n  { latency_us = 30.0, busbw_GBps = 400.0 },\n]\n"
    )
    (tmp_path / "run.toml").write_text(RUN.format(calibration='calibration = "cal.toml"'))
    res = CliRunner().invoke(app, ["estimate", str(tmp_path / "run.toml"), "--json"])
    (warning,) = json.loads(res.stdout)["calibration"]["warnings"]
    assert "busbw_GBps = 1e+06 for sizes <= 65,536 B" in warning
    assert "2 x its 450 GB/s links" in warning
