"""The routed experts' GEMMs by how the framework launches them (``training.moe_expert_gemm``,
perf/step/moe_kernels.py): one grouped kernel per projection, or one cuBLAS launch per local expert
(Transformer Engine's GroupedLinear on its cuBLAS path, as Megatron-Core's TEGroupedMLP runs it)."""

from __future__ import annotations

import csv

import pytest

from aihpc.perf.fit.validate import data_file
from aihpc.perf.step.compute import layer_times
from aihpc.perf.step.estimate import estimate_plan
from aihpc.perf.step.gemm import gemm_time_s
from aihpc.perf.step.moe_kernels import expert_gemm_time_s, routed_expert_gemms
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec.errors import SpecError
from aihpc.runspec.runspec import runspec_from_dict
from aihpc.runspec.training import TrainingSpec

LAUNCH = DEFAULT_PARAMS.kernel_overhead_s


def qwen_30b(precision: str, how: str = "grouped"):
    """Qwen3-30B-A3B on 16 H100s with EP 16 (H09's plan): 8 local experts of 768."""
    return runspec_from_dict(
        {
            "model": {"preset": "qwen3-30b-a3b"},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 16},
            "parallel": {
                "global_batch_size": 1024,
                "tp": 1,
                "pp": 1,
                "ep": 16,
                "zero_stage": 1,
                "recompute": "none",
                "micro_batch_size": 1,
            },
            "training": {"precision": precision, "moe_expert_gemm": how},
        }
    )


def test_one_projection_of_the_local_experts() -> None:
    """Grouped: the experts' bodies and one launch; per expert: a launch each, and under FP8 a
    quantize launch each as well."""
    one = 30e-6
    assert expert_gemm_time_s(one, 8, "bf16", DEFAULT_PARAMS, "grouped") == pytest.approx(
        8 * (one - LAUNCH) + LAUNCH
    )
    assert expert_gemm_time_s(one, 8, "bf16", DEFAULT_PARAMS, "per_expert") == pytest.approx(
        8 * one
    )
    assert expert_gemm_time_s(one, 8, "fp8", DEFAULT_PARAMS, "per_expert") == pytest.approx(
        8 * one + 8 * LAUNCH
    )
    # one local expert: the grouped kernel and the single launch are the same kernel
    assert expert_gemm_time_s(one, 1, "bf16", DEFAULT_PARAMS, "per_expert") == pytest.approx(one)


@pytest.mark.parametrize(("precision", "extra_per_expert"), [("bf16", 1), ("fp8", 2)])
def test_per_expert_launches_add_to_the_moe_layer_only(
    precision: str, extra_per_expert: int
) -> None:
    """An MoE layer's forward GEMMs grow by exactly the launches: two projections, E/ep = 8 local
    experts each, (8 - 1) extra GEMM launches (and 8 quantize launches under FP8); the backward
    (dgrad and wgrad) twice that; a dense layer does not change."""
    g, p = qwen_30b(precision), qwen_30b(precision, "per_expert")
    args = (g.model, g.cluster.gpu, g.plan())
    grouped = layer_times(*args, g.training, DEFAULT_PARAMS, moe=True)
    per = layer_times(*args, p.training, DEFAULT_PARAMS, moe=True)
    extra = 2 * (8 * extra_per_expert - 1) * LAUNCH
    assert per.fwd_gemm - grouped.fwd_gemm == pytest.approx(extra)
    assert per.bwd_gemm - grouped.bwd_gemm == pytest.approx(2 * extra)
    assert per.fwd_elementwise == grouped.fwd_elementwise
    dense_g = layer_times(*args, g.training, DEFAULT_PARAMS)
    dense_p = layer_times(*args, p.training, DEFAULT_PARAMS)
    assert dense_g == dense_p


def test_the_expert_bodies_are_priced_at_their_own_rows() -> None:
    """Each expert's product is priced at tokens-per-expert rows: 4,096 tokens x top-8 over 8
    local experts is 4,096 rows each, SwiGLU's gate and up fused (2 x 768 wide)."""
    s = qwen_30b("bf16", "per_expert")
    gpu = s.cluster.gpu
    routed, _, _ = routed_expert_gemms(s.model, gpu, s.plan(), s.training, DEFAULT_PARAMS, None)
    router = gemm_time_s(4096, 128, 2048, gpu, "bf16", DEFAULT_PARAMS)
    fc1 = gemm_time_s(4096, 2 * 768, 2048, gpu, "bf16", DEFAULT_PARAMS)
    fc2 = gemm_time_s(4096, 2048, 768, gpu, "bf16", DEFAULT_PARAMS)
    assert routed - router == pytest.approx(8 * (fc1 + fc2))


def test_the_step_is_slower_with_per_expert_launches() -> None:
    g, p = qwen_30b("fp8"), qwen_30b("fp8", "per_expert")
    a = estimate_plan(g.model, g.cluster, g.plan(), g.training)
    b = estimate_plan(p.model, p.cluster, p.plan(), p.training)
    assert b.time_s["compute"] > a.time_s["compute"]
    assert b.time_s["ep_comm"] == pytest.approx(a.time_s["ep_comm"])


def test_unknown_expert_gemm_is_refused() -> None:
    with pytest.raises(SpecError) as err:
        TrainingSpec(moe_expert_gemm="cutlass")
    assert "grouped" in str(err.value) and "per_expert" in str(err.value)


def test_megatron_bridge_rows_launch_per_expert() -> None:
    """The Megatron-Bridge rows ran Megatron-Core's TEGroupedMLP (moe_grouped_gemm = True in
    every MoE recipe), which hands Transformer Engine the token counts as a host list: its
    per-expert cuBLAS path. DeepSeek's own run (K01) used grouped kernels (DeepGEMM)."""
    with open(data_file("moe_runs.csv"), encoding="utf-8") as f:
        rows = {r["id"]: r for r in csv.DictReader(f)}
    # H19 and H20 ran Transformer Engine's fused grouped MLP (NVTE_CUTEDSL_FUSED_GROUPED_MLP) with
    # device-side token counts under a full-iteration CUDA graph, which the per-expert path's
    # host read of the counts could not be captured in.
    grouped = {"H19", "H20"}
    for rid, row in rows.items():
        expected = "grouped" if rid in grouped else "per_expert" if rid.startswith("H") else ""
        assert row["moe_expert_gemm"] == expected, rid
