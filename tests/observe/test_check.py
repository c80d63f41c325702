"""``aihpc check``: the tools' output parsed in their documented formats, expectations from the
GPU catalog and the collective model, and the CPU path run for real against calibrations made
from its own measurement (one that the node cannot reach, one that it must)."""

from __future__ import annotations

import json
import stat

import pytest
from typer.testing import CliRunner

from aihpc.cli import app
from aihpc.observe.check import (
    Expectations,
    comm_checks,
    detect_gpu_id,
    gemm_checks,
    gpu_checks,
    ib_checks,
    leftover_process_checks,
    parse_ibstat,
    slurm_job_gpu_count,
)
from aihpc.perf.step.comm import collective_time_s
from aihpc.runspec.calibration import (
    Calibration,
    CommFit,
    CommRegime,
    GemmFit,
    busbw_factor,
    calibration_to_toml,
)
from aihpc.runspec.cluster import cluster_from_table, gpu_from_id

# nvidia-smi --query-gpu=index,name,pci.bus_id,memory.total,
#   ecc.errors.uncorrected.volatile.total,remapped_rows.pending,remapped_rows.failure
#   --format=csv,noheader,nounits   (field names: nvidia-smi --help-query-gpu)
SMI_OK = """0, NVIDIA H100 80GB HBM3, 00000000:18:00.0, 81559, 0, No, No
1, NVIDIA H100 80GB HBM3, 00000000:2A:00.0, 81559, 0, No, No
"""
SMI_BAD = """0, NVIDIA H100 80GB HBM3, 00000000:18:00.0, 81559, 0, No, No
1, NVIDIA H100 80GB HBM3, 00000000:2A:00.0, 81559, 2, Yes, No
2, NVIDIA H100 80GB HBM3, 00000000:3A:00.0, 81559, [N/A], [N/A], [N/A]
"""
# ibstat (infiniband-diags) prints one block per CA and per port
IBSTAT = """CA 'mlx5_0'
\tCA type: MT4129
\tNumber of ports: 1
\tFirmware version: 28.39.1002
\tHardware version: 0
\tNode GUID: 0xa088c20300f1e2d0
\tSystem image GUID: 0xa088c20300f1e2d0
\tPort 1:
\t\tState: Active
\t\tPhysical state: LinkUp
\t\tRate: 400
\t\tBase lid: 112
\t\tLMC: 0
\t\tSM lid: 1
\t\tCapability mask: 0xa751e848
\t\tPort GUID: 0xa088c20300f1e2d0
\t\tLink layer: InfiniBand
CA 'mlx5_1'
\tCA type: MT4129
\tNumber of ports: 1
\tPort 1:
\t\tState: Down
\t\tPhysical state: Polling
\t\tRate: 10
\t\tBase lid: 65535
\t\tLink layer: InfiniBand
"""


def test_nvidia_smi_healthy_node_passes():
    results = gpu_checks(SMI_OK, 0, expected_count=2)
    assert [r.status for r in results] == ["pass", "pass"]
    assert results[-1].measured.startswith("2 GPU(s)")


def test_nvidia_smi_errors_fail_one_line_each():
    results = gpu_checks(SMI_BAD, 0, expected_count=8)
    failed = [r.line() for r in results if r.status == "fail"]
    assert failed == [
        "FAIL gpu count: measured 3; expected 8",
        "FAIL gpu 1 (00000000:2A:00.0) ECC: measured 2 uncorrectable; expected 0",
        "FAIL gpu 1 (00000000:2A:00.0) row remap: measured pending; expected none; reset the GPU",
    ]


def test_missing_tools_are_skipped_with_a_reason():
    assert gpu_checks(None)[0].status == "skip" and "nvidia-smi" in gpu_checks(None)[0].detail
    assert ib_checks(None)[0].status == "skip" and "ibstat" in ib_checks(None)[0].detail
    assert gpu_checks("NVIDIA-SMI has failed", 9)[0].status == "fail"


def test_missing_tools_fail_what_was_asked_for():
    """Asked for GPUs or NIC ports the node's tools cannot show, the check fails: as a Slurm
    prolog it must not pass a node whose driver or ibstat is gone."""
    (gpu,) = gpu_checks(None, expected_count=8)
    assert gpu.status == "fail" and gpu.expected == "8" and "nvidia-smi" in gpu.detail
    (nic,) = ib_checks(None, min_rate_gbps=400)
    assert nic.status == "fail" and "400 Gb/s" in nic.expected and "ibstat" in nic.detail
    (nic,) = ib_checks(None, hcas=("mlx5_0",))
    assert nic.status == "fail" and "mlx5_0" in nic.expected


def _tool_path(tmp_path, tools: dict[str, str]) -> str:
    """A PATH holding only these tools (shell scripts printing their documented output) and the
    shell they run in, so the node's own nvidia-smi or ibstat can neither help nor hide."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for name, body in tools.items():
        exe = folder / name
        exe.write_text(f"#!/bin/sh\n{body}\n")
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(folder)


def test_cli_fails_a_node_without_the_tools_it_was_asked_about(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _tool_path(tmp_path, {}))
    args = ["check", "--gpus", "8", "--ib-rate", "400", "--skip-bench", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc["failed"] == 2
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("FAIL gpu count: measured none visible; expected 8")
    assert lines[1].startswith("FAIL nics: measured none visible")


def test_slurm_gpu_count_from_the_prolog_environment():
    assert slurm_job_gpu_count({"SLURM_JOB_GPUS": "0,1,2,3"}) == 4
    assert slurm_job_gpu_count({"SLURM_JOB_GPUS": ""}) is None
    assert slurm_job_gpu_count({}) is None


def test_epilog_fails_on_a_process_left_on_a_gpu():
    # nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader,nounits
    left = "4121, /usr/bin/python3, 60211\n4188, /usr/bin/python3, 512\n"
    (check,) = leftover_process_checks(left)
    assert check.status == "fail" and check.measured == "2 left" and "PID 4121" in check.detail
    assert leftover_process_checks("")[0].status == "pass"
    assert leftover_process_checks(None)[0].status == "skip"


@pytest.mark.parametrize("mode", ["prolog", "epilog"])
def test_slurm_modes_end_to_end(tmp_path, monkeypatch, mode):
    """As slurmd runs them: the job's GPU count from SLURM_JOB_GPUS (3 asked, 2 visible), no
    benchmark, and an epilog that finds the job's process still on GPU 1."""
    smi = (
        'case "$1" in --query-compute-apps*) echo "4121, python3, 60211";; '
        "*) printf '%s\\n%s\\n' "
        '"0, NVIDIA H100 80GB HBM3, 00000000:18:00.0, 81559, 0, No, No" '
        '"1, NVIDIA H100 80GB HBM3, 00000000:2A:00.0, 81559, 0, No, No";; esac'
    )
    monkeypatch.setenv("PATH", _tool_path(tmp_path, {"nvidia-smi": smi}) + ":/bin:/usr/bin")
    monkeypatch.setenv("SLURM_JOB_GPUS", "0,1,2")
    result = CliRunner().invoke(app, ["check", "--mode", mode, "--json"])
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc["gemm"] == [] and doc["comm"] == []  # no benchmark in a prolog / epilog
    failed = {c["name"]: c for c in doc["checks"] if c["status"] == "fail"}
    assert failed["gpu count"]["measured"] == "2" and failed["gpu count"]["expected"] == "3"
    assert ("gpu processes" in failed) == (mode == "epilog")


def test_ibstat_ports():
    ports = parse_ibstat(IBSTAT)
    assert [(p.ca, p.port, p.state, p.rate_gbps) for p in ports] == [
        ("mlx5_0", 1, "Active", 400.0),
        ("mlx5_1", 1, "Down", 10.0),
    ]
    results = ib_checks(IBSTAT, 0, min_rate_gbps=400)
    assert [r.status for r in results] == ["pass", "fail"]
    assert [r.status for r in ib_checks(IBSTAT, 0, hcas=("mlx5_0",))] == ["pass"]


@pytest.mark.parametrize(
    ("name", "mib", "gpu_id"),
    [
        ("NVIDIA H100 80GB HBM3", 81559, "h100-sxm"),
        ("NVIDIA A100-SXM4-40GB", 40960, "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", 81920, "a100-80gb"),
        ("NVIDIA H200", 143771, "h200"),
        ("Tesla T4", 15360, None),
    ],
)
def test_gpu_names_map_to_the_catalog(name, mib, gpu_id):
    assert detect_gpu_id(name, mib) == gpu_id


def test_catalog_expectations():
    h100 = gpu_from_id("h100-sxm")
    exp = Expectations(h100, None, 8)
    big = exp.gemm_tflops(2 * 8192**3 / 1e9, "bf16")
    assert big == pytest.approx(h100.sustained_peak_tflops("bf16") * h100.gemm_efficiency)
    assert exp.gemm_tflops(2 * 1024**3 / 1e9, "bf16") is None  # the efficiency is for big GEMMs
    size = 256 << 20
    seconds = collective_time_s(
        cluster_from_table({"gpu": "h100-sxm", "num_gpus": 8, "gpus_per_node": 8}),
        "all_reduce",
        size,
        8,
    )
    expect = size * busbw_factor("all_reduce", 8) / seconds / 1e9
    assert exp.busbw_GBps("all_reduce", size, "scale_up", 8) == pytest.approx(expect)
    assert expect < h100.scale_up_bw_GBps  # the model's bus bandwidth stays under the link's


def _calibration(gemm_rows, comm_rows, tflops, busbw):
    """A calibration of flat figures: ``tflops`` for every GEMM, ``busbw`` GB/s (latency 0)."""
    tier = comm_rows[0]["tier"]
    fit = CommFit("all_reduce", tier, (CommRegime(0.0, busbw),), num_ranks=2)
    prec = gemm_rows[0]["precision"]
    return Calibration(
        comm={("all_reduce", tier): fit},
        gemm={prec: GemmFit(prec, ((1.0, tflops), (1000.0, tflops)))},
        source=f"{tflops} TFLOP/s, {busbw} GB/s",
    )


@pytest.mark.slow
def test_cpu_node_against_calibrations(tmp_path):
    """The CPU path for real: against a calibration no machine reaches, every figure fails
    (exit 1, one line each on stderr, the measurements still in the JSON), and the same
    measurements pass one that any machine reaches."""
    impossible = tmp_path / "impossible.toml"
    impossible.write_text(
        calibration_to_toml(_calibration([{"precision": "fp32"}], [{"tier": "scale_up"}], 1e6, 1e6))
    )
    result = CliRunner().invoke(app, ["check", "--calibration", str(impossible), "--json"])
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    gemm, comm = doc["gemm"], doc["comm"]
    assert len(gemm) == 2 and len(comm) == 2 and all(r["wrong"] == 0 for r in comm)
    assert {c["status"] for c in doc["checks"]} == {"skip", "fail"}  # no GPU, no NIC tools
    lines = result.stderr.strip().splitlines()
    assert len(lines) == doc["failed"] == len(gemm) + len(comm)
    assert all(line.startswith("FAIL ") and "of calibration" in line for line in lines)
    reachable = _calibration(gemm, comm, 1e-9, 1e-9)
    checks = gemm_checks(gemm, Expectations(None, reachable, 2), 0.8)
    checks += comm_checks(comm, Expectations(None, reachable, 2), 0.8)
    assert [c.status for c in checks] == ["pass"] * 4


def test_bad_input_exits_2(tmp_path):
    for args in (["--min-ratio", "1.5"], ["--nproc-per-node", "0"], ["--mode", "pre"]):
        result = CliRunner().invoke(app, ["check", *args])
        assert result.exit_code == 2 and args[0] in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    result = CliRunner().invoke(app, ["check", "--calibration", str(tmp_path / "no.toml")])
    assert result.exit_code == 2 and "no.toml" in result.stderr
