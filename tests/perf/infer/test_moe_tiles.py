"""A decode step's routed experts in a fused-MoE grouped GEMM: each expert's few rows fill the
small M tile the kernel picks for them (not whole 64-row tiles), and the launch's efficiency is
that of the whole grouped launch, so small-batch expert GEMMs are bound by their weight reads."""

from __future__ import annotations

import math

import pytest

from aihpc.perf.infer.kernels import (
    GEMM_M_TILE,
    MOE_M_TILES,
    Engine,
    expert_rows,
    routed_experts_s,
)
from aihpc.perf.infer.kv import ServingPlan
from aihpc.perf.step.flops import mlp_params
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec.cluster import GPUSpec, gpu_from_id
from aihpc.runspec.model import model_from_table

QWEN = model_from_table({"preset": "qwen3-235b-a22b"})
H100 = gpu_from_id("h100-sxm")


def engine(gpu=H100, **plan) -> Engine:
    return Engine(QWEN, gpu, ServingPlan(**plan), DEFAULT_PARAMS)


@pytest.mark.parametrize("rows", [1, 4, 15, 16, 17, 31, 33, 64, 65, 200])
def test_expert_rows_take_the_smallest_tile_that_holds_them(rows: int) -> None:
    got = expert_rows(engine(), rows)
    assert got >= rows
    fitting = [t for t in MOE_M_TILES if rows <= t]
    if fitting:  # one tile, the smallest that holds the rows
        assert got == min(fitting)
    else:  # beyond the largest small tile: whole 64-row tiles
        assert got == math.ceil(rows / GEMM_M_TILE) * GEMM_M_TILE


def test_a_cpu_host_computes_the_rows_themselves() -> None:
    cpu = GPUSpec(
        bf16_tflops=0.1, fp32_tflops=0.1, hbm_gib=8, hbm_bw_GBps=20, scale_up_bw_GBps=5,
        scale_up_domain=1, scale_out_bw_GBps=5, gpus_per_node=1, host_is_device=True,
    )  # fmt: skip
    assert expert_rows(engine(cpu), 5) == 5


def test_small_decode_batches_read_the_touched_experts_weights() -> None:
    # 64 sequences over TP8: each touched expert gets a handful of copies; the grouped GEMM is
    # bound by the touched experts' weight reads, within the copies' activation bytes
    e = engine(tp=8, ep=8)
    t = routed_experts_s(e, 64)
    touched = 1 - (1 - QWEN.moe_top_k / QWEN.num_experts) ** 64
    weights = QWEN.num_experts / 8 * touched * mlp_params(QWEN, QWEN.expert_ffn_hidden_size) * 2
    floor = weights / (H100.hbm_bw_GBps * 1e9 * DEFAULT_PARAMS.hbm_efficiency)
    assert t == pytest.approx(floor, rel=0.05)
    # a prefill chunk's thousands of copies per expert: compute-bound, past every weight read
    assert routed_experts_s(e, 16384) > 2 * floor / touched
