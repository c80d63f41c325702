"""`calibrate --local` times a CPU's GEMMs with their operands out of the cache, as a training
step's GEMMs find them (bench/gemm.py ``cold_bytes``): how many operand pairs a shape rotates
through, and that the timing runs so (counts, not times)."""

from __future__ import annotations

import pytest

from aihpc.bench import local
from aihpc.bench.gemm import GemmConfig, operand_pairs, run_gemm_bench

torch = pytest.importorskip("torch")


def test_the_pairs_hold_the_cold_bytes() -> None:
    hot = GemmConfig(shapes=((128, 128, 128),), precision="fp32")
    cold = GemmConfig(shapes=((128, 128, 128),), precision="fp32", cold_bytes=64 << 20)
    assert operand_pairs(128, 128, 128, hot) == 1
    pair = 2 * 128 * 128 * 4  # A and B, fp32
    assert operand_pairs(128, 128, 128, cold) == (64 << 20) // pair
    # a pair larger than the bytes: one
    assert operand_pairs(4096, 4096, 4096, GemmConfig(((4096,) * 3,), "fp32", cold_bytes=1)) == 1
    # the largest calibrated shape: 8 MiB a pair, 8 pairs
    assert operand_pairs(1024, 1024, 1024, cold) == 8


def test_a_cold_timing_runs_every_shape() -> None:
    cfg = GemmConfig(shapes=((64, 64, 64), (96, 32, 64)), precision="fp32", iters=3,
                     cold_bytes=1 << 20)  # fmt: skip
    results = run_gemm_bench(cfg, torch.device("cpu"))
    assert [(r.m, r.n, r.k) for r in results] == list(cfg.shapes)
    assert all(r.tflops > 0 for r in results)


def test_calibrate_local_times_a_cpus_gemms_cold() -> None:
    """The CPU calibration's operands span more than a server CPU's last-level cache."""
    assert local._COLD_BYTES >= 64 << 20
