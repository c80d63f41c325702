"""``aihpc check``: one node's acceptance test. GPU and NIC presence and health from the vendor
tools where they exist, and brief GEMM and collective benchmarks compared with the figures the
node should reach: a calibration file (``aihpc calibrate``) when given, else the GPU catalog
(dense peak x sustained large-GEMM efficiency) and ``aihpc.perf``'s collective model.

This module holds no torch: the CLI runs ``aihpc.bench`` and hands its rows here (the GEMM rows
of ``aihpc bench gemm --json``, the rows of ``aihpc bench comm --json``); the tools' output is
parsed from text, so each parser is tested on the documented format.

Prior art (shared/research/comm-cluster-anchors.md 2.6): DCGM's level-1 diagnostic, nebius
soperator's prolog (nvidia-smi must answer, drain on failure), nccl-tests' NCCL_TESTS_MIN_BW
(fail below 0.9 x the expected bus bandwidth).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from aihpc.runspec.calibration import Calibration, busbw_factor
from aihpc.runspec.cluster import GPUSpec, cluster_from_table, gpu_catalog, gpu_from_id

__all__ = [
    "NVIDIA_SMI_APPS_QUERY",
    "NVIDIA_SMI_QUERY",
    "CheckResult",
    "Expectations",
    "IBPort",
    "comm_checks",
    "detect_gpu_id",
    "gemm_checks",
    "gpu_checks",
    "ib_checks",
    "leftover_process_checks",
    "parse_ibstat",
    "parse_nvidia_smi",
    "run_tool",
    "slurm_job_gpu_count",
]

# Large GEMMs only: the catalog's efficiency is what a big matmul sustains, not a small one.
LARGE_GEMM_GFLOP = 500.0
NVIDIA_SMI_QUERY = (
    "index,name,pci.bus_id,memory.total,ecc.errors.uncorrected.volatile.total,"
    "remapped_rows.pending,remapped_rows.failure"
)
NVIDIA_SMI_APPS_QUERY = "pid,process_name,used_memory"


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: str  # pass | fail | skip | info
    measured: str = ""
    expected: str = ""
    detail: str = ""

    def line(self) -> str:
        parts = [f"{self.status.upper()} {self.name}"]
        if self.measured:
            parts.append(f"measured {self.measured}")
        if self.expected:
            parts.append(f"expected {self.expected}")
        if self.detail:
            parts.append(self.detail)
        return ": ".join(parts[:1]) + (": " + "; ".join(parts[1:]) if parts[1:] else "")

    def to_json(self) -> dict[str, str]:
        return asdict(self)


def run_tool(args: Sequence[str], timeout_s: float = 30.0) -> tuple[int, str] | None:
    """(exit code, stdout + stderr) of a tool, or None when it is not installed."""
    if shutil.which(args[0]) is None:
        return None
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return 124, f"{args[0]} did not answer in {timeout_s:.0f} s"
    return proc.returncode, proc.stdout + proc.stderr


# ---- GPUs -------------------------------------------------------------------------------------
def parse_nvidia_smi(text: str) -> list[dict[str, Any]]:
    """Rows of ``nvidia-smi --query-gpu=NVIDIA_SMI_QUERY --format=csv,noheader,nounits``."""
    keys = NVIDIA_SMI_QUERY.split(",")
    rows = []
    for line in text.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(keys):
            continue
        rows.append(dict(zip(keys, cells, strict=True)))
    return rows


def _known(value: str) -> bool:
    return value not in ("[N/A]", "N/A", "[Not Supported]", "")


def gpu_checks(
    text: str | None, code: int = 0, expected_count: int | None = None
) -> list[CheckResult]:
    """Presence (``nvidia-smi`` answers, the count), no uncorrectable ECC errors since boot, no
    pending or failed row remapping (NVIDIA: a pending remap needs a GPU reset; a failure,
    service) per GPU."""
    if text is None and expected_count:
        # Asked for GPUs it cannot see: a prolog must not pass a node whose driver is gone.
        why = f"nvidia-smi is not installed: cannot see the {expected_count} GPU(s) asked for"
        return [CheckResult("gpu count", "fail", "none visible", str(expected_count), why)]
    if text is None:
        return [CheckResult("gpus", "skip", detail="nvidia-smi is not installed (no NVIDIA GPU)")]
    if code != 0:
        return [CheckResult("gpus", "fail", detail=f"nvidia-smi failed: {text.strip()[:200]}")]
    gpus = parse_nvidia_smi(text)
    out = []
    count_ok = expected_count is None or len(gpus) == expected_count
    want = "" if expected_count is None else str(expected_count)
    out.append(CheckResult("gpu count", "pass" if count_ok else "fail", str(len(gpus)), want))
    for g in gpus:
        name = f"gpu {g['index']} ({g['pci.bus_id']})"
        ecc = g["ecc.errors.uncorrected.volatile.total"]
        if _known(ecc) and int(ecc) > 0:
            out.append(CheckResult(f"{name} ECC", "fail", f"{ecc} uncorrectable", "0"))
        if _known(g["remapped_rows.pending"]) and g["remapped_rows.pending"].lower() == "yes":
            out.append(CheckResult(f"{name} row remap", "fail", "pending", "none", "reset the GPU"))
        if _known(g["remapped_rows.failure"]) and g["remapped_rows.failure"].lower() == "yes":
            out.append(CheckResult(f"{name} row remap", "fail", "failed", "none", "RMA"))
    if gpus and all(c.status == "pass" for c in out):
        out.append(CheckResult("gpu health", "pass", f"{len(gpus)} GPU(s): ECC and remap clean"))
    return out


def detect_gpu_id(name: str, memory_mib: float | None = None) -> str | None:
    """The catalog id of an ``nvidia-smi`` GPU name: the id's family (``h100``) in the name,
    the closest memory size among several (A100 40 vs 80 GB)."""
    lowered = name.lower()
    matches = [gid for gid in gpu_catalog() if gid.split("-")[0] in lowered]
    if not matches:
        return None
    if len(matches) == 1 or memory_mib is None:
        return matches[0]
    gib = memory_mib / 1024
    return min(matches, key=lambda gid: abs(gpu_from_id(gid).hbm_gib - gib))


def slurm_job_gpu_count(env: dict[str, str]) -> int | None:
    """GPUs Slurm gave the job on this node, from a prolog's or epilog's environment: slurmd sets
    ``SLURM_JOB_GPUS`` (the allocated GPU indices, comma-separated) when the job has GPUs
    (Slurm's Prolog and Epilog Guide); None when it does not say."""
    gpus = env.get("SLURM_JOB_GPUS", "").strip()
    return len([g for g in gpus.split(",") if g.strip()]) if gpus else None


def leftover_process_checks(text: str | None, code: int = 0) -> list[CheckResult]:
    """An epilog's check: no process still holds a GPU after the job ended (rows of
    ``nvidia-smi --query-compute-apps=NVIDIA_SMI_APPS_QUERY --format=csv,noheader,nounits``).
    A process that outlived its job keeps the GPU's memory, and the next job fails with an OOM."""
    if text is None:
        return [CheckResult("gpu processes", "skip", detail="nvidia-smi is not installed")]
    if code != 0:
        return [CheckResult("gpu processes", "fail", detail=f"nvidia-smi failed: {text[:200]}")]
    rows = [[c.strip() for c in line.split(",")] for line in text.strip().splitlines()]
    rows = [r for r in rows if len(r) >= 2 and r[0].isdigit()]
    if not rows:
        return [CheckResult("gpu processes", "pass", "none", "none")]
    listed = ", ".join(f"PID {r[0]} ({r[1]})" for r in rows[:8])
    return [CheckResult("gpu processes", "fail", f"{len(rows)} left", "none", listed)]


# ---- InfiniBand / RoCE -------------------------------------------------------------------------
@dataclass(frozen=True)
class IBPort:
    ca: str
    port: int
    state: str
    physical_state: str
    rate_gbps: float | None
    link_layer: str


def parse_ibstat(text: str) -> list[IBPort]:
    """``ibstat`` (infiniband-diags): ``CA 'mlx5_0'`` blocks with ``Port N:`` sub-blocks."""
    ports: list[IBPort] = []
    ca, port, fields = None, None, {}

    def flush() -> None:
        if ca is not None and port is not None:
            rate = fields.get("Rate")
            ports.append(
                IBPort(
                    ca,
                    port,
                    fields.get("State", "?"),
                    fields.get("Physical state", "?"),
                    float(rate) if rate and re.fullmatch(r"[\d.]+", rate) else None,
                    fields.get("Link layer", "?"),
                )
            )

    for line in text.splitlines():
        if m := re.match(r"^CA '([^']+)'", line):
            flush()
            ca, port, fields = m.group(1), None, {}
        elif m := re.match(r"^\s+Port (\d+):\s*$", line):
            flush()
            port, fields = int(m.group(1)), {}
        elif port is not None and (m := re.match(r"^\s+([\w ]+):\s*(.*)$", line)):
            fields[m.group(1).strip()] = m.group(2).strip()
    flush()
    return ports


def ib_checks(
    text: str | None, code: int = 0, hcas: Sequence[str] = (), min_rate_gbps: float | None = None
) -> list[CheckResult]:
    """Every port (of ``hcas``, NCCL_IB_HCA's list, when given) Active and LinkUp at the rate."""
    if text is None and (hcas or min_rate_gbps):
        asked = ", ".join(
            ([f"HCAs {','.join(hcas)}"] if hcas else [])
            + ([f"ports at >= {min_rate_gbps:g} Gb/s"] if min_rate_gbps else [])
        )
        why = f"ibstat is not installed: cannot see the {asked} asked for"
        return [CheckResult("nics", "fail", "none visible", asked, why)]
    if text is None:
        return [CheckResult("nics", "skip", detail="ibstat is not installed (no InfiniBand/RoCE)")]
    ports = [p for p in parse_ibstat(text) if not hcas or p.ca in hcas]
    if code != 0 or not ports:
        return [CheckResult("nics", "fail", detail=f"ibstat found no port: {text.strip()[:200]}")]
    out = []
    for p in ports:
        name = f"{p.ca} port {p.port} ({p.link_layer})"
        up = p.state == "Active" and p.physical_state == "LinkUp"
        fast = min_rate_gbps is None or (p.rate_gbps or 0) >= min_rate_gbps
        out.append(
            CheckResult(
                name,
                "pass" if up and fast else "fail",
                f"{p.state}, {p.physical_state}, {p.rate_gbps or '?'} Gb/s",
                "Active, LinkUp" + (f", >= {min_rate_gbps:g} Gb/s" if min_rate_gbps else ""),
            )
        )
    return out


# ---- performance ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Expectations:
    """What the node should reach: a calibration file's fits, else the GPU catalog and the
    collective model for ``num_ranks`` GPUs of one node."""

    gpu: GPUSpec | None = None
    calibration: Calibration | None = None
    num_ranks: int = 1

    @property
    def source(self) -> str:
        if self.calibration is not None:
            return f"calibration {self.calibration.path or self.calibration.source}"
        return f"catalog {self.gpu.id}" if self.gpu else "none"

    def gemm_tflops(self, gflop: float, precision: str) -> float | None:
        if self.calibration is not None and precision in self.calibration.gemm:
            return self.calibration.gemm[precision].achieved_tflops(gflop)
        if self.gpu is None or gflop < LARGE_GEMM_GFLOP:
            return None
        eff = self.gpu.large_gemm_efficiency(precision)
        return self.gpu.sustained_peak_tflops(precision) * eff if eff else None

    def busbw_GBps(self, collective: str, size_bytes: int, tier: str, n: int) -> float | None:
        factor = busbw_factor(collective, n)
        fit = self.calibration.comm_fit(collective, tier) if self.calibration else None
        if fit is not None:
            r = fit.regime(size_bytes)
            seconds = r.latency_us * 1e-6 + size_bytes * factor / (r.busbw_GBps * 1e9)
        elif self.gpu is not None and tier == "scale_up":
            from aihpc.perf.step.comm import collective_time_s

            cluster = cluster_from_table({"gpu": self.gpu.id, "num_gpus": n, "gpus_per_node": n})
            seconds = collective_time_s(cluster, collective, size_bytes, n)
        else:
            return None
        return size_bytes * factor / seconds / 1e9


def _judge(
    name: str, measured: float, expected: float | None, unit: str, min_ratio: float, src: str
) -> CheckResult:
    if expected is None:
        why = "give --calibration (aihpc calibrate) or --gpu" if src == "none" else f"not in {src}"
        return CheckResult(name, "info", f"{measured:.4g} {unit}", detail=f"no expectation: {why}")
    ok = measured >= min_ratio * expected
    return CheckResult(
        name,
        "pass" if ok else "fail",
        f"{measured:.4g} {unit}",
        f">= {min_ratio:g} x {expected:.4g} {unit}",
        f"{measured / expected:.0%} of {src}",
    )


def gemm_checks(
    rows: Sequence[dict[str, Any]], exp: Expectations, min_ratio: float
) -> list[CheckResult]:
    """One check per GEMM shape: achieved TFLOP/s against the expected."""
    out = []
    for r in rows:
        name = f"gemm {r['precision']} {r['m']}x{r['n']}x{r['k']}"
        expected = exp.gemm_tflops(float(r["gflop"]), str(r["precision"]))
        out.append(_judge(name, float(r["tflops"]), expected, "TFLOP/s", min_ratio, exp.source))
    return out


def comm_checks(
    rows: Sequence[dict[str, Any]], exp: Expectations, min_ratio: float
) -> list[CheckResult]:
    """One check per collective and size: no wrong element, and bus bandwidth (out-of-place,
    nccl-tests' definition) against the expected."""
    out = []
    for r in rows:
        size = int(r["size_bytes"])
        name = f"{r['collective']} {_size(size)} on {r['num_ranks']} ranks"
        if r.get("wrong"):
            out.append(CheckResult(name, "fail", f"{r['wrong']} wrong element(s)", "0"))
            continue
        expected = exp.busbw_GBps(r["collective"], size, r["tier"], int(r["num_ranks"]))
        out.append(
            _judge(name, float(r["busbw_GBps"]), expected, "GB/s busbw", min_ratio, exp.source)
        )
    return out


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"
