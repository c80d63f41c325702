"""ClusterSpec: *where* it is trained — GPU part, node size, scale-up and scale-out networks."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from aihpc.runspec._table import check_positive, from_table, lookup_name
from aihpc.runspec.calibration import Calibration
from aihpc.runspec.errors import SpecError

__all__ = ["PRECISIONS", "ClusterSpec", "GPUSpec", "cluster_from_table", "gpu_catalog"]

PRECISIONS = ("bf16", "fp16", "fp8")


# Throughput of compute-bound work under a power limit scales as (limit / TDP) ** this exponent.
# Measured, not derived: NVIDIA's MLPerf Inference v4.0 runs of Llama 2 70B (FP8, offline) on
# DGX H100 gave 21,805.8 tokens/s at 700 W and 17,561.6 at its MaxQ power_limit = 450 W, same batch
# and software (mlcommons/inference_results_v4.0, closed/NVIDIA/results/DGX-H100_H100-SXM-80GBx8
# _TRT{,_MaxQ}/llama2-70b-99.9/Offline/performance/run_1/mlperf_log_summary.txt and
# closed/NVIDIA/configs/llama2-70b/Offline/__init__.py): 0.805 = (450/700) ** 0.49. The cube-root
# rule of dynamic power (f * V^2 with V ~ f) would give 0.86; static and memory power, which a
# cap does not lower, leave less for the clocks.
POWER_CAP_EXPONENT = 0.49


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator part. Peaks are dense tensor-core TFLOP/s; bandwidths per direction."""

    bf16_tflops: float
    hbm_gib: float
    hbm_bw_GBps: float
    scale_up_bw_GBps: float
    scale_up_domain: int
    scale_out_bw_GBps: float
    fp16_tflops: float | None = None
    fp8_tflops: float | None = None
    fp32_tflops: float | None = None
    tdp_w: float | None = None
    power_limit_w: float | None = None  # set when the part runs capped below its TDP
    gemm_efficiency: float | None = None  # sustained fraction of peak on large GEMMs
    gemm_efficiency_fp8: float | None = None
    # Contraction length at which a layer GEMM reaches half its long-K efficiency, 16-bit and FP8
    # (None: the efficiency does not depend on K); the catalog's gemm_efficiency is read at
    # K = 4096 (perf/step/gemm.GEMM_REFERENCE_K).
    gemm_half_k: float | None = None
    gemm_half_k_fp8: float | None = None
    attention_fwd_efficiency: float | None = None  # best fused attention kernel on this part
    attention_bwd_efficiency: float | None = None
    flash2_fwd_efficiency: float | None = None  # FlashAttention-2 where it is not the best kernel
    flash2_bwd_efficiency: float | None = None
    # Where the attention figures above were measured and how they fall at shorter calls: the
    # key length of one call (None: the catalog's 16K, perf/attention_kernels.REFERENCE_TOKENS)
    # and the key lengths at which this part's kernel reaches half its long-call figure,
    # forward and backward (None: the kernel class's, measured on an H200). `aihpc calibrate
    # --local` writes all three from its own attention timings at two lengths.
    attention_tokens: float | None = None
    attention_half_fwd_tokens: float | None = None
    attention_half_bwd_tokens: float | None = None
    # What one NCCL channel (one CTA) moves point-to-point over the scale-up links, per
    # direction: it matters where a job caps a communicator's CTAs
    # (training.cp_comm_ctas, pp_comm_ctas).
    p2p_channel_bw_GBps: float | None = None
    # The GPU's link to host memory (PCIe, or NVLink-C2C on Grace superchips), per direction, as
    # a copy engine sustains it (gpus.toml says what each figure measured); and the host memory
    # that falls to each GPU. They matter where a plan offloads activations (offload_layers).
    host_link_GBps: float | None = None
    host_mem_gib: float | None = None
    # The "device" is the host's CPU (`aihpc calibrate --local` on a machine without a GPU):
    # the host's own time per op (eager DTensor dispatch) adds to the step instead of running
    # ahead of the device's kernels.
    host_is_device: bool = False
    # The rate a matrix-vector product reads its weights, GB/s (a decode step of a small batch
    # streams every weight once per token row): on a CPU it is below a copy's (the
    # hbm_bw_GBps a STREAM-like copy measures); None: the HBM bandwidth at hbm_efficiency.
    # The inference estimate reads layer weights at it (perf/infer/kernels.py).
    weight_stream_GBps: float | None = None
    # Where the host is the device: one eager op's host time, microseconds (None: the model's
    # host_cpu_op_s), and the rate one decode step's attention call reads K and V, counted once
    # per query head, GB/s (None: the KV bytes at the HBM bandwidth). `aihpc calibrate --local`
    # measures both on the CPU clock (bench/local_decode.py).
    host_op_us: float | None = None
    decode_attention_GBps: float | None = None
    # Where the host is the device: what a fresh page of a large allocation costs the training
    # step (perf/step/page_faults.py). ``page_fault_us``: one page mapped, touched and unmapped,
    # microseconds of CPU time; ``fresh_fault_fraction``: the share of the pages of a step's
    # large fresh allocations that the allocator takes from the kernel again (faulted in) once
    # its thresholds settle, measured on the trainer's own step. `aihpc calibrate --local`
    # measures both; None (every GPU): not priced.
    page_fault_us: float | None = None
    fresh_fault_fraction: float | None = None
    gpus_per_node: int = 8
    id: str = "custom"  # catalog id
    name: str = "custom"
    source: str = ""

    def __post_init__(self) -> None:
        for f in (
            "bf16_tflops",
            "hbm_gib",
            "hbm_bw_GBps",
            "scale_up_bw_GBps",
            "scale_up_domain",
            "scale_out_bw_GBps",
            "fp16_tflops",
            "fp8_tflops",
            "fp32_tflops",
            "tdp_w",
            "power_limit_w",
            "p2p_channel_bw_GBps",
            "host_link_GBps",
            "host_mem_gib",
            "weight_stream_GBps",
            "host_op_us",
            "decode_attention_GBps",
            "page_fault_us",
            "gpus_per_node",
            "attention_tokens",
        ):
            check_positive(f"cluster.gpu_spec.{f}", getattr(self, f))
        for f in ("gemm_half_k", "gemm_half_k_fp8"):  # 0: no fall-off at short K
            check_positive(f"cluster.gpu_spec.{f}", getattr(self, f), allow_zero=True)
        for f in (
            "gemm_efficiency",
            "gemm_efficiency_fp8",
            "attention_fwd_efficiency",
            "attention_bwd_efficiency",
            "flash2_fwd_efficiency",
            "flash2_bwd_efficiency",
        ):
            value = getattr(self, f)
            if value is not None and not 0 < value <= 1:  # a fraction of the peak
                raise SpecError(f"cluster.gpu_spec.{f}", value, "must be a fraction in (0, 1]")
        for f in ("attention_half_fwd_tokens", "attention_half_bwd_tokens"):  # 0: no fall-off
            check_positive(f"cluster.gpu_spec.{f}", getattr(self, f), allow_zero=True)
        share = self.fresh_fault_fraction
        if share is not None and not 0 <= share <= 1:  # a share of pages: none may fault
            raise SpecError("cluster.gpu_spec.fresh_fault_fraction", share, "must be in [0, 1]")

    def peak_tflops(self, precision: str) -> float:
        """Dense peak at ``precision``; refuses to guess for a precision the part lacks."""
        # branches, not a dict built per call: the search prices thousands of GEMMs through here
        if precision == "bf16":
            value: float | None = self.bf16_tflops
        elif precision == "fp8":
            value = self.fp8_tflops
        elif precision == "fp16":
            value = self.fp16_tflops or self.bf16_tflops
        else:
            value = None
        if value is None:
            have = [p for p in PRECISIONS if p != "fp8" or self.fp8_tflops]
            raise SpecError(
                "training.precision",
                precision,
                f"GPU {self.id!r} has no {precision} peak; allowed: {', '.join(have)}",
            )
        return value

    def sustained_peak_tflops(self, precision: str) -> float:
        """Peak at the clock the part sustains under its power limit (what kernels can reach)."""
        return self.peak_tflops(precision) * self.clock_ratio

    @property
    def clock_ratio(self) -> float:
        """Sustained tensor throughput under a power cap relative to the TDP's:
        (limit / tdp) ** POWER_CAP_EXPONENT."""
        if self.power_limit_w and self.tdp_w and self.power_limit_w < self.tdp_w:
            return (self.power_limit_w / self.tdp_w) ** POWER_CAP_EXPONENT
        return 1.0

    def attention_efficiency(self, kernel: str) -> tuple[float | None, float | None]:
        """(forward, backward) fraction of the 16-bit peak for ``kernel`` (flash | flash2)."""
        if kernel == "flash2" and self.flash2_fwd_efficiency:
            return self.flash2_fwd_efficiency, self.flash2_bwd_efficiency
        return self.attention_fwd_efficiency, self.attention_bwd_efficiency

    def gemm_half_k_for(self, precision: str) -> float | None:
        """Half-efficiency contraction length of a GEMM at ``precision`` (None: K-free)."""
        if precision == "fp8":
            return self.gemm_half_k_fp8 if self.gemm_half_k_fp8 is not None else self.gemm_half_k
        return self.gemm_half_k

    def large_gemm_efficiency(self, precision: str) -> float | None:
        if precision == "fp8":
            return self.gemm_efficiency_fp8 or self.gemm_efficiency
        return self.gemm_efficiency


@cache
def gpu_catalog() -> dict[str, dict[str, Any]]:
    """Catalog tables from ``runspec/data/gpus.toml`` (each with its source)."""
    return tomllib.loads(resources.files("aihpc.runspec").joinpath("data/gpus.toml").read_text())


def gpu_from_id(gpu_id: str) -> GPUSpec:
    catalog = gpu_catalog()
    gpu_id = lookup_name("cluster.gpu", gpu_id, catalog)  # "H100-SXM" is "h100-sxm"
    return from_table(GPUSpec, {"id": gpu_id, **catalog[gpu_id]}, "cluster.gpu_spec")


@dataclass(frozen=True)
class ClusterSpec:
    """The machine. Overrides of the GPU's network figures describe a particular cluster."""

    gpu: GPUSpec
    num_gpus: int
    gpus_per_node: int
    scale_up_domain: int  # GPUs on one NVLink domain (a node for HGX, a rack for NVL72)
    scale_up_bw_GBps: float
    scale_out_bw_GBps: float
    storage_write_bw_GBps: float | None = None  # aggregate checkpoint write bandwidth of the job
    storage_read_bw_GBps: float | None = None
    calibration: Calibration | None = None
    # GiB per GPU a plan must leave free (allocator spikes, a framework's own buffers, margin):
    # the estimate fits a plan, and the search ranks only plans, within hbm_gib minus this
    memory_headroom_gib: float = 0.0

    def __post_init__(self) -> None:
        for f in (
            "num_gpus",
            "gpus_per_node",
            "scale_up_domain",
            "scale_up_bw_GBps",
            "scale_out_bw_GBps",
            "storage_write_bw_GBps",
            "storage_read_bw_GBps",
        ):
            check_positive(f"cluster.{f}", getattr(self, f))
        check_positive("cluster.memory_headroom_gib", self.memory_headroom_gib, allow_zero=True)
        if self.memory_headroom_gib >= self.gpu.hbm_gib:
            raise SpecError(
                "cluster.memory_headroom_gib",
                self.memory_headroom_gib,
                f"must leave memory to use: below the GPU's {self.gpu.hbm_gib:g} GiB",
            )
        if self.scale_up_domain % self.gpus_per_node and self.gpus_per_node % self.scale_up_domain:
            raise SpecError(
                "cluster.scale_up_domain",
                self.scale_up_domain,
                f"must be a multiple or a divisor of gpus_per_node {self.gpus_per_node}",
            )
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise SpecError(
                "cluster.num_gpus",
                self.num_gpus,
                f"must be a multiple of gpus_per_node {self.gpus_per_node}",
            )

    @property
    def usable_hbm_gib(self) -> float:
        """GPU memory a plan may fill: the part's, less the headroom the spec keeps free."""
        return self.gpu.hbm_gib - self.memory_headroom_gib

    @property
    def num_nodes(self) -> int:
        return max(1, self.num_gpus // self.gpus_per_node)

    @property
    def nvlink_domain(self) -> int:
        """GPUs reachable over the scale-up fabric, capped by the job size."""
        return min(self.scale_up_domain, self.num_gpus)


_CLUSTER_KEYS = (
    "gpu",
    "gpu_spec",
    "num_gpus",
    "gpus_per_node",
    "scale_up_domain",
    "scale_up_bw_GBps",
    "scale_out_bw_GBps",
    "storage_write_bw_GBps",
    "storage_read_bw_GBps",
    "calibration",
    "memory_headroom_gib",
)


def cluster_from_table(
    table: dict[str, Any], calibration: Calibration | None = None
) -> ClusterSpec:
    """``[cluster]`` table → ClusterSpec. ``gpu = "id"`` or a ``[cluster.gpu_spec]`` table."""
    for key, value in table.items():
        if key not in _CLUSTER_KEYS:
            raise SpecError(
                f"cluster.{key}",
                value,
                "unknown field; allowed: " + ", ".join(sorted(_CLUSTER_KEYS)),
            )
    if "gpu" in table and not isinstance(table["gpu"], str):
        raise SpecError("cluster.gpu", table["gpu"], "expected a catalog id string")
    if "gpu_spec" in table:
        if not isinstance(table["gpu_spec"], dict):
            raise SpecError("cluster.gpu_spec", table["gpu_spec"], "expected a table")
        spec_table = dict(table["gpu_spec"])
        if "gpu" in table:  # start from a catalog part, override some figures
            gpu_id = lookup_name("cluster.gpu", table["gpu"], gpu_catalog())
            spec_table = {**gpu_catalog()[gpu_id], "id": gpu_id, **spec_table}
        gpu = from_table(GPUSpec, spec_table, "cluster.gpu_spec")
    elif "gpu" in table:
        gpu = gpu_from_id(table["gpu"])
    else:
        raise SpecError(
            "cluster.gpu",
            None,
            'required: a catalog id (e.g. "h100-sxm") or a [cluster.gpu_spec] table',
        )
    if "num_gpus" not in table:
        raise SpecError("cluster.num_gpus", None, "required field is missing")
    fields = {k: v for k, v in table.items() if k not in ("gpu", "gpu_spec", "calibration")}
    gpn = fields.get("gpus_per_node", gpu.gpus_per_node)
    fields.setdefault("gpus_per_node", gpn)
    # An HGX-style part's NVLink domain is its node; a rack-scale part (NVL72) spans nodes.
    rack_scale = gpu.scale_up_domain > gpu.gpus_per_node
    fields.setdefault("scale_up_domain", gpu.scale_up_domain if rack_scale else gpn)
    fields.setdefault("scale_up_bw_GBps", gpu.scale_up_bw_GBps)
    fields.setdefault("scale_out_bw_GBps", gpu.scale_out_bw_GBps)
    return from_table(ClusterSpec, fields, "cluster", gpu=gpu, calibration=calibration)
