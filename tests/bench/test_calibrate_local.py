"""`aihpc calibrate --local`: this host measured with the bench commands, written as a calibration
and as the spec's copy for this host, which `aihpc estimate` then prices with the measurements."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("torch")

from aihpc.bench import local
from aihpc.bench.local import (
    AttentionCurve,
    LocalMeasurement,
    MeasurementError,
    PLAUSIBLE_MEM_BW_GBps,
    check_memory_bandwidth,
    local_gpu_spec,
)
from aihpc.cli import app

ROOT = Path(__file__).resolve().parents[2]


def _aihpc(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "aihpc", *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )


def test_local_calibration_prices_the_spec_on_this_host(tmp_path: Path) -> None:
    spec = tmp_path / "tiny.toml"
    spec.write_text((ROOT / "examples" / "tiny-train.toml").read_text())
    r = _aihpc("calibrate", "--local", "--nproc", "1", "--spec", str(spec), "-o", "cal.toml",
               cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    # one line per phase on stderr as it starts (i of n, elapsed), then the time taken
    phases = [line for line in r.stderr.splitlines() if line.startswith("[")]
    assert [p.split()[0] for p in phases] == [f"[{i}/6]" for i in range(1, 7)], r.stderr
    whats = ("memory", "GEMMs", "attention", "decode", "DTensor", "page")
    for phase, what in zip(phases, whats, strict=True):
        assert re.fullmatch(rf"\[\d/6\] \d+:\d\d {what}\b.+", phase), phase
    assert re.search(r"^measured in \d+ s$", r.stderr, re.M), r.stderr
    cal = tomllib.loads((tmp_path / "cal.toml").read_text())
    measured = {g["precision"]: g["points"] for g in cal["gemm"]}
    # the CPU runtime trains a bf16 spec in fp32: the fp32 measurements price both
    assert measured["bf16"] == measured["fp32"] and len(measured["fp32"]) == 4
    assert all(tflops > 0 for _, tflops in measured["fp32"])
    local = tomllib.loads((tmp_path / "tiny.local.toml").read_text())
    cluster = local["cluster"]
    assert cluster["num_gpus"] == cluster["gpus_per_node"] == 1 and "gpu" not in cluster
    assert cluster["calibration"] == "cal.toml"
    # a CPU host's page faults (perf/step/page_faults.py): a fault's cost and the share that fault
    assert cluster["gpu_spec"]["page_fault_us"] > 0
    assert 0 <= cluster["gpu_spec"]["fresh_fault_fraction"] <= 1
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
    low, high = PLAUSIBLE_MEM_BW_GBps["cpu"]
    assert low <= cluster["gpu_spec"]["hbm_bw_GBps"] <= high
    # a decode step's own figures, measured on the CPU clock: weights streamed by a one-row
    # product (a memory rate of the same order as the copy's), one eager op (microseconds), the
    # one-query attention call's K and V bytes per query head
    gpu = cluster["gpu_spec"]
    assert low <= gpu["weight_stream_GBps"] <= high and low <= gpu["decode_attention_GBps"]
    assert 0.05 < gpu["host_op_us"] < 1000
    assert cal["dtensor_op_us"] >= 0 and cal["dtensor_optimizer_op_us"] >= 0
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


# Runs pinned to one core beside busy processes on the same core: the copy's wall clock then
# counts their time slices too. Prints the bandwidth alone, then with SPINNERS beside it.
_LOADED = """
import os, subprocess, sys
import torch
from aihpc.bench.local import memory_bandwidth_GBps
core = min(os.sched_getaffinity(0))
os.sched_setaffinity(0, {core})
torch.set_num_threads(1)
cpu = torch.device("cpu")
alone = memory_bandwidth_GBps(cpu)
spin = f"import os; os.sched_setaffinity(0, {{{core}}})\\nwhile True: pass"
procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(int(sys.argv[1]))]
try:
    loaded = memory_bandwidth_GBps(cpu)
finally:
    for p in procs:
        p.kill()
        p.wait()
print(alone, loaded)
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins processes to a core")
def test_memory_bandwidth_holds_beside_busy_processes_on_its_core() -> None:
    """Issue 34's 0.30 GB/s came from a host at load 10-30: timed on the wall clock, a copy
    measures the share of the core the scheduler gave it (0.86 GB/s beside 15 busy processes,
    18.6 on the copying thread's CPU time). With twelve busy processes on the copy's core the
    figure stays within a factor 2 of the one measured alone (0.9-1.2 of it in three runs, where
    the wall-clock figure of the code before fell to 0.11-0.31)."""
    r = subprocess.run(
        [sys.executable, "-c", _LOADED, "12"], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    alone, loaded = map(float, r.stdout.split())
    low, high = PLAUSIBLE_MEM_BW_GBps["cpu"]
    assert low <= alone <= high and loaded >= alone / 2, (alone, loaded)


def test_an_implausible_memory_bandwidth_is_refused_with_the_figure_and_range() -> None:
    check_memory_bandwidth("cpu", 19.6)  # this host's figure
    check_memory_bandwidth("cuda", 4800.0)  # an H200's
    for kind, figure in (("cpu", 0.30), ("cpu", 5e4), ("cuda", 5.0)):
        with pytest.raises(MeasurementError) as err:
            check_memory_bandwidth(kind, figure)
        low, high = PLAUSIBLE_MEM_BW_GBps[kind]
        assert f"{figure:.3g} GB/s" in str(err.value) and f"{low:g}-{high:g} GB/s" in str(err.value)


def test_calibrate_local_refuses_before_measuring_more(tmp_path: Path, monkeypatch) -> None:
    """A memory figure no CPU gives ends the command at once (exit 1, the figure, the range,
    nothing written), before the GEMMs and the minutes after them; the phase line precedes
    the refusal, and --json prints no phase lines."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(local, "memory_bandwidth_GBps", lambda device: 0.30)
    monkeypatch.setattr(local, "load_warning", lambda: None)

    def no_gemms(*args: object) -> None:
        raise AssertionError("GEMMs measured after an implausible memory bandwidth")

    monkeypatch.setattr(local, "_gemms", no_gemms)
    runner = CliRunner()
    for extra, phase_lines in (((), 1), (("--json",), 0)):
        r = runner.invoke(app, ["calibrate", "--local", "--nproc", "1", "-o", "cal.toml", *extra])
        assert r.exit_code == 1, r.output
        lines = r.stderr.strip().splitlines()
        assert len(lines) == phase_lines + 1, r.stderr
        assert "memory bandwidth measured 0.3 GB/s" in lines[-1] and "1-2000 GB/s" in lines[-1]
        assert "nothing written" in lines[-1] and r.stdout == ""
        if phase_lines:
            assert lines[0].startswith("[1/6] 0:00 memory bandwidth")
    assert list(tmp_path.iterdir()) == []


def test_memory_bandwidth_is_a_ranks_own_not_divided_by_the_ranks() -> None:
    """Each of N ranks copies on its own core at the rank's thread count, the count the copy
    was timed at: the gpu_spec's figure is the measured one (it was divided by N, halving it
    for two ranks)."""
    m = LocalMeasurement(
        nproc=2, threads_per_rank=1, device="CPU", comm={},
        gemm={"results": [{"tflops": 0.09}]}, mem_bw_GBps=19.6, host_mem_gib=24.0,
        attention=AttentionCurve((0.02, 0.02), 64, (0.0, 0.0)),
    )  # fmt: skip
    spec = local_gpu_spec(m)
    assert spec["hbm_bw_GBps"] == 19.6 and spec["hbm_gib"] == 12.0  # memory size is shared


def test_load_warning_names_the_load_and_the_cores(monkeypatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (14.25, 9.0, 5.0))
    assert local.load_warning().startswith("load average 14.2 on 2 cores")
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 1.0, 1.0))
    assert local.load_warning() is None
