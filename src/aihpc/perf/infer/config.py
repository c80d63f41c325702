"""A run spec's ``[inference]`` table (runspec.inference.InferenceSpec) as the planner's
objects: the serving plan, the prefill pool's plan and the load."""

from __future__ import annotations

from aihpc.perf.infer.kv import ServingPlan
from aihpc.perf.infer.serving import Load
from aihpc.perf.infer.software import software_for
from aihpc.runspec.inference import InferenceSpec

__all__ = ["prefill_plan_of", "serving_load", "serving_plan"]


def serving_plan(spec: InferenceSpec) -> ServingPlan:
    return ServingPlan(
        spec.tp,
        spec.pp,
        spec.dp,
        spec.ep,
        spec.kv_dtype,
        spec.weight_dtype,
        spec.block_size,
        software_for(spec.engine),
        spec.moe_imbalance,
    )


def prefill_plan_of(spec: InferenceSpec) -> ServingPlan:
    """The prefill pool's plan of a disaggregated deployment (dtypes as the decode pool's)."""
    return ServingPlan(
        tp=spec.prefill_tp,
        dp=spec.prefill_dp,
        ep=spec.prefill_ep,
        kv_dtype=spec.kv_dtype,
        weight_dtype=spec.weight_dtype,
        block_size=spec.block_size,
        software=software_for(spec.engine),
        moe_imbalance=spec.moe_imbalance,
    )


def serving_load(spec: InferenceSpec) -> Load:
    return Load(
        prompt_len=spec.prompt_len,
        output_len=spec.output_len,
        max_seqs=spec.max_seqs,
        max_batched_tokens=spec.max_batched_tokens,
        chunked_prefill=spec.chunked_prefill,
        prefix_hit=spec.prefix_hit,
        gpu_memory_utilization=spec.gpu_memory_utilization,
        kv_free_fraction=spec.kv_free_fraction,
        reserve_full=spec.reserve_full,
    )
