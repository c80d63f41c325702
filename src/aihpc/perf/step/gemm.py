"""GEMM and stream kernels on a roofline: a GEMM's achieved fraction of the part's dense peak by
its size and contraction length (or from a calibration), and memory-bound element-wise work at
HBM bandwidth. Every other kernel class (compute.py, moe_kernels.py, dp_comm.py) is priced with
these two. All times are for one GPU, in seconds.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from aihpc.perf.step.params import ModelParams
from aihpc.runspec.calibration import Calibration
from aihpc.runspec.cluster import GPUSpec

__all__ = [
    "GEMM_REFERENCE_K",
    "contraction_factor",
    "gemm_bwd_s",
    "gemm_efficiency",
    "gemm_time_s",
    "stream_time_s",
]


# The contraction length at which the catalog's layer-GEMM efficiencies are read: the median
# layer GEMM of benchmarks/results/kernel_efficiency_h200.md contracts over 4,096 (the hidden
# size of the 8B-class models and the FFN input of most), and its K-curve's median factor is
# this length's (0.974 BF16, 0.930 FP8), so normalising there keeps the catalog's figures.
GEMM_REFERENCE_K = 4096.0


def contraction_factor(k: Any, half_k: float) -> Any:
    """A GEMM's efficiency at contraction length ``k`` over its efficiency at GEMM_REFERENCE_K,
    on the curve K / (K + half_k): each output tile pays a prologue (first loads) and an
    epilogue (convert and store the accumulator) once, whatever the number of K steps its main
    loop runs, so their share falls as 1 / K. Fitted on the H200's 50 layer GEMMs per precision
    (kernel_efficiency_h200.md, K 1,024-28,672): rms error per shape 3.8% -> 2.8% (BF16),
    7.7% -> 3.3% (FP8) against a K-free figure."""
    ref = GEMM_REFERENCE_K
    return k * (ref + half_k) / (ref * (k + half_k))


def gemm_efficiency(
    gpu: GPUSpec,
    precision: str,
    gflop: Any,
    params: ModelParams,
    calibration: Calibration | None,
    k: Any = None,
    peak: float | None = None,
) -> Any:
    """Achieved fraction of the dense peak for one GEMM of ``gflop`` GFLOP contracting over
    ``k`` (None: the reference length); the part's ``gemm_half_k`` sets how it falls at short
    K, where measured. ``peak``: the part's sustained peak at ``precision``, if known."""
    if calibration is not None and precision in calibration.gemm:
        if peak is None:
            peak = gpu.sustained_peak_tflops(precision)
        eff = calibration.gemm[precision].achieved_tflops(gflop) / peak
    else:
        large = gpu.large_gemm_efficiency(precision) or params.gemm_efficiency
        eff = large * gflop / (gflop + params.gemm_half_efficiency_gflop)
        half_k = gpu.gemm_half_k_for(precision)
        if half_k and k is not None:  # never past the peak
            eff = eff * contraction_factor(k, half_k)
            eff = np.minimum(1.0, eff) if isinstance(eff, np.ndarray) else min(1.0, eff)
    if calibration is not None and calibration.efficiency is not None:
        # a scale fitted to measured runs (aihpc calibrate --runs); never past the peak
        eff = min(1.0, eff * calibration.scale("gemm"))
    return eff


def gemm_time_s(
    m: float,
    n: float,
    k: float,
    gpu: GPUSpec,
    precision: str,
    params: ModelParams,
    calibration: Calibration | None = None,
    batch: float = 1,
) -> float:
    """``batch`` (m x k) @ (k x n) products in one kernel (one GEMM, or torch.bmm / baddbmm):
    the slower of compute, at the efficiency of the whole launch, and memory traffic (each
    product's own operands), plus one launch cost."""
    flops = 2.0 * batch * m * n * k
    peak = gpu.sustained_peak_tflops(precision)
    eff = gemm_efficiency(gpu, precision, flops / 1e9, params, calibration, k, peak)
    compute = flops / (peak * 1e12 * eff)
    elem = 1.0 if precision == "fp8" else 2.0
    traffic = batch * ((m * k + k * n) * elem + m * n * 2.0)
    memory = traffic / (gpu.hbm_bw_GBps * 1e9 * params.hbm_efficiency)
    return max(compute, memory) + params.kernel_overhead_s


def stream_time_s(num_bytes: Any, gpu: GPUSpec, params: ModelParams, kernels: int = 1) -> Any:
    """Memory-bound element-wise work moving ``num_bytes`` through HBM (a float or an array)."""
    return (
        num_bytes / (gpu.hbm_bw_GBps * 1e9 * params.hbm_efficiency)
        + kernels * params.kernel_overhead_s
    )


def gemm_bwd_s(gemm: Any, m: Any, n: Any, k: Any) -> Any:
    """Backward of a linear whose forward GEMM is (m x k) @ (k x n), priced by ``gemm(m, n, k)``:
    the input gradient (m x n) @ (n x k) contracts over n, the weight gradient (k x m) @ (m x n)
    over the m rows. Each has the forward's FLOPs and operand sizes; only the contraction
    length differs, which matters where the part's efficiency depends on it (``gemm_half_k``)."""
    return gemm(m, k, n) + gemm(k, n, m)
