"""A layer GEMM's efficiency by its contraction length K (``gemm_half_k`` in gpus.toml), and the
backward's GEMMs priced at their own K: checked against the H200 GEMM table the curve was fitted
on, and for what it must leave alone (parts without a K sweep, calibrated GEMMs)."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from aihpc.perf.step.gemm import (
    GEMM_REFERENCE_K,
    contraction_factor,
    gemm_bwd_s,
    gemm_efficiency,
    gemm_time_s,
)
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec.cluster import gpu_from_id

TABLE = Path(__file__).resolve().parents[2] / "benchmarks/results/kernel_efficiency_h200.json"


def _layer_gemms(precision: str) -> list[dict]:
    rows = json.loads(TABLE.read_text())["gemm"]
    return [r for r in rows if r["precision"] == precision and not r["case"].startswith("cube")]


def _rms_of_ratio(measured: list[float], priced: list[float]) -> float:
    """rms relative error of each shape against the table's median, so the catalog's sustained
    level (below a short benchmark's) does not enter: only how efficiency varies by shape."""
    m_med, p_med = statistics.median(measured), statistics.median(priced)
    errs = [(p / p_med) / (m / m_med) - 1 for m, p in zip(measured, priced, strict=True)]
    return math.sqrt(sum(e * e for e in errs) / len(errs))


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_the_k_curve_follows_the_measured_h200_layer_gemms(precision: str) -> None:
    """Priced per shape, the H200's layer GEMMs vary as measured: the K curve's rms error by shape
    is below the K-free figure's (3.8% -> 2.8% BF16, 7.7% -> 3.3% FP8 when fitted)."""
    h200 = gpu_from_id("h200")
    flat = replace(h200, gemm_half_k=None, gemm_half_k_fp8=None)
    rows = _layer_gemms(precision)
    assert len(rows) >= 40
    measured = [r["tflops"] for r in rows]

    def priced(gpu) -> list[float]:
        out = []
        for r in rows:
            s = gemm_time_s(r["m"], r["n"], r["k"], gpu, precision, DEFAULT_PARAMS)
            out.append(2 * r["m"] * r["n"] * r["k"] / s / 1e12)
        return out

    with_k, without_k = _rms_of_ratio(measured, priced(h200)), _rms_of_ratio(measured, priced(flat))
    assert with_k < without_k
    assert with_k < {"bf16": 0.035, "fp8": 0.04}[precision]


def test_the_catalog_figure_holds_at_the_reference_length_and_falls_at_short_k() -> None:
    h100 = gpu_from_id("h100-sxm")
    big = 1e6  # GFLOP: the size term is 1 to within 1e-6
    for precision, large in (("bf16", h100.gemm_efficiency), ("fp8", h100.gemm_efficiency_fp8)):
        at_ref = gemm_efficiency(h100, precision, big, DEFAULT_PARAMS, None, GEMM_REFERENCE_K)
        assert at_ref == pytest.approx(large, rel=1e-6)
        short = gemm_efficiency(h100, precision, big, DEFAULT_PARAMS, None, 512)
        half_k = h100.gemm_half_k_for(precision)
        assert short == pytest.approx(large * contraction_factor(512, half_k), rel=1e-6)
        assert short < at_ref < gemm_efficiency(h100, precision, big, DEFAULT_PARAMS, None, 16384)
    # FP8 loses more at short K than BF16 (half-efficiency K 310 against 110)
    assert contraction_factor(1024, h100.gemm_half_k_fp8) < contraction_factor(
        1024, h100.gemm_half_k
    )


def test_parts_without_a_k_sweep_and_calibrated_gemms_stay_k_free() -> None:
    b200 = gpu_from_id("b200")
    assert b200.gemm_half_k_for("fp8") is None
    e = [gemm_efficiency(b200, "fp8", 500.0, DEFAULT_PARAMS, None, k) for k in (512, 4096, 65536)]
    assert e[0] == e[1] == e[2]


def test_the_backward_gemms_contract_over_their_own_lengths() -> None:
    """The attention output projection under TP 8 contracts over 512 in the forward; its input
    gradient contracts over the hidden size and its weight gradient over the tokens, so on a part
    with a K curve its backward costs less than twice its forward, and on one without exactly
    twice (compute-bound shapes: each of the three GEMMs has the same FLOPs)."""
    m, n, k = 16384.0, 4096.0, 512.0
    for gpu_id, below in (("h100-sxm", True), ("b200", False)):
        gpu = gpu_from_id(gpu_id)

        def gemm(a: float, b: float, c: float, g=gpu) -> float:
            return gemm_time_s(a, b, c, g, "bf16", DEFAULT_PARAMS)

        fwd, bwd = gemm(m, n, k), gemm_bwd_s(gemm, m, n, k)
        if below:
            assert bwd < 2 * fwd * 0.95
        else:
            assert bwd == pytest.approx(2 * fwd, rel=1e-12)
