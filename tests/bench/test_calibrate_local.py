"""`aihpc calibrate --local`: this host measured with the bench commands, written as a calibration
and as the spec's copy for this host, which `aihpc estimate` then prices with the measurements."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


def _aihpc(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "aihpc", *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )


def test_local_calibration_prices_the_spec_on_this_host(tmp_path: Path) -> None:
    spec = tmp_path / "tiny.toml"
    spec.write_text((ROOT / "examples" / "tiny-train.toml").read_text())
    r = _aihpc("calibrate", "--local", "--nproc", "1", "--spec", str(spec), "-O", "cal.toml",
               cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    cal = tomllib.loads((tmp_path / "cal.toml").read_text())
    measured = {g["precision"]: g["points"] for g in cal["gemm"]}
    # the CPU runtime trains a bf16 spec in fp32: the fp32 measurements price both
    assert measured["bf16"] == measured["fp32"] and len(measured["fp32"]) == 4
    assert all(tflops > 0 for _, tflops in measured["fp32"])
    local = tomllib.loads((tmp_path / "tiny.local.toml").read_text())
    cluster = local["cluster"]
    assert cluster["num_gpus"] == cluster["gpus_per_node"] == 1 and "gpu" not in cluster
    assert cluster["calibration"] == "cal.toml"
    best = max(t for _, t in measured["fp32"])
    # the calibration file keeps 4 significant digits (relative rounding <= 5e-4)
    assert cluster["gpu_spec"]["bf16_tflops"] == pytest.approx(best, rel=5e-4)
    for key in ("attention_fwd_efficiency", "attention_bwd_efficiency"):
        assert 0 < cluster["gpu_spec"][key] <= 1
    # measured at the spec model's own calls, with this device's fall-off at half the length
    from aihpc.runspec import load_runspec

    model = load_runspec(spec).model
    assert cluster["gpu_spec"]["attention_tokens"] == model.seq_length
    for key in ("attention_half_fwd_tokens", "attention_half_bwd_tokens"):
        assert cluster["gpu_spec"][key] >= 0
    # a CPU host is its own device, and DTensor's dispatch cost per op was measured on it
    assert cluster["gpu_spec"]["host_is_device"] is True
    assert cal["dtensor_op_us"] >= 0
    assert local["model"] == tomllib.loads(spec.read_text())["model"]
    est = _aihpc("estimate", "tiny.local.toml", "--json", cwd=tmp_path)
    assert est.returncode == 0, est.stderr
    doc = json.loads(est.stdout)
    assert doc["calibration"]["path"].endswith("cal.toml")
    assert doc["step_time_s"] > 0


def test_local_needs_no_inputs_and_inputs_no_local(tmp_path: Path) -> None:
    for args in (["calibrate"], ["calibrate", "x.json", "--local"], ["calibrate", "--spec", "s"]):
        r = _aihpc(*args, cwd=tmp_path)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []
