"""A serving GPU's memory: weights, the activation workspace of the largest step, the runtime's
own (CUDA graphs, NCCL and library workspaces), and what is left for the paged KV cache within
the share of the GPU the engine may use (vLLM's ``gpu_memory_utilization``, SGLang's
``mem_fraction_static``); the largest batch of sequences whose pages fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from aihpc.perf.infer.kv import (
    ServingPlan,
    kv_bytes_per_token,
    paged_tokens,
    weight_bytes_per_gpu,
)
from aihpc.perf.step.params import ModelParams
from aihpc.runspec.model import ModelSpec

__all__ = ["GIB", "InferenceMemory", "inference_memory"]

GIB = float(1 << 30)


@dataclass(frozen=True)
class InferenceMemory:
    """GiB per GPU. ``kv_cache``: the batch's pages; ``kv_capacity``: what the engine's share
    leaves for pages; ``max_batch``: sequences of the given length whose pages fit in it (per
    data-parallel rank times dp: the whole instance)."""

    usable: float
    weights: float
    activations: float
    runtime: float
    kv_cache: float
    kv_capacity: float
    kv_bytes_per_token: float
    kv_capacity_tokens: float
    max_batch: int

    @property
    def total(self) -> float:
        return self.weights + self.activations + self.runtime + self.kv_cache

    @property
    def fits(self) -> bool:
        return self.kv_capacity > 0 and self.kv_cache <= self.kv_capacity + 1e-9

    def to_json(self) -> dict[str, Any]:
        return {
            "usable_gib": self.usable,
            "weights_gib": self.weights,
            "activations_gib": self.activations,
            "runtime_gib": self.runtime,
            "kv_cache_gib": self.kv_cache,
            "kv_capacity_gib": self.kv_capacity,
            "total_gib": self.total,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "max_batch": self.max_batch,
            "fits": self.fits,
        }


def activation_bytes(
    model: ModelSpec, plan: ServingPlan, step_tokens: float, sampled: float, act_bytes: float
) -> float:
    """Workspace of the largest step: the residual stream and one layer's widest
    intermediates for ``step_tokens`` tokens (hidden x 4, the local FFN's gate and up, the
    local QKV), and FP32 logits of the ``sampled`` sequences; freed layer by layer, so one
    layer's worth."""
    h = model.hidden_size
    ffn = model.ffn_hidden_size
    if model.is_moe:
        ffn = max(ffn, model.expert_ffn_hidden_size * (model.moe_top_k + model.num_shared_experts))
    qkv = (model.num_attention_heads + 2 * model.kv_heads) * model.kv_channels
    width = 4 * h + (3 * ffn + qkv) / plan.tp
    return step_tokens * width * act_bytes + sampled * model.vocab_size / plan.tp * 4.0


def inference_memory(
    model: ModelSpec,
    hbm_gib: float,
    plan: ServingPlan,
    params: ModelParams,
    *,
    batch: float,
    seq_len: float,
    step_tokens: float,
    gpu_memory_utilization: float,
    act_bytes: float = 2.0,
    kv_free_fraction: float | None = None,
) -> InferenceMemory:
    """The memory of serving ``batch`` sequences (the whole instance's) of ``seq_len`` tokens
    each (prompt and output), steps of at most ``step_tokens`` tokens per data-parallel rank.
    The engine may use ``gpu_memory_utilization`` of the GPU (vLLM's convention), or, with
    ``kv_free_fraction``, give the KV cache that share of what the weights, workspace and
    runtime leave free (TensorRT-LLM's kv_cache_free_gpu_mem_fraction)."""
    usable = hbm_gib * gpu_memory_utilization
    weights = weight_bytes_per_gpu(model, plan) / GIB
    per_dp = batch / plan.dp
    acts = activation_bytes(model, plan, step_tokens, per_dp, act_bytes) / GIB
    runtime = params.runtime_overhead_gib
    if kv_free_fraction is not None:
        free = hbm_gib - weights - acts - runtime
        usable = weights + acts + runtime + kv_free_fraction * max(free, 0.0)
    per_token = kv_bytes_per_token(model, plan, seq_len)
    pages = paged_tokens(seq_len, plan.block_size)
    kv = per_dp * pages * per_token / GIB
    capacity = usable - weights - acts - runtime
    cap_tokens = max(0.0, capacity * GIB / per_token) if per_token else math.inf
    max_batch = int(cap_tokens // pages) * plan.dp if capacity > 0 else 0
    return InferenceMemory(
        usable=usable,
        weights=weights,
        activations=acts,
        runtime=runtime,
        kv_cache=kv,
        kv_capacity=capacity,
        kv_bytes_per_token=per_token,
        kv_capacity_tokens=cap_tokens,
        max_batch=max_batch,
    )
