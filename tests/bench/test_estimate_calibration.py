"""End to end: nccl-tests logs -> aihpc calibrate -> [cluster] calibration -> aihpc estimate."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aihpc.cli import app
from aihpc.spec.calibration import Calibration, calibration_to_toml, load_calibration

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
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


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
    res = CliRunner().invoke(app, ["calibrate", *logs, "-O", str(tmp_path / "cal.toml")])
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
