"""Serving plans for a latency target, ranked by throughput per GPU.

Every plan of at most ``gpus`` GPUs (tp within the NVLink domain, pp, attention dp and ep for
MoE models, the KV dtype given and FP8) is priced in steady state (serving.steady_state) at the
largest number of sequences in flight that meets the TPOT target (TPOT grows with the batch:
bisected), within what its KV cache holds; plans that cannot meet a target even at one
sequence, or whose weights do not fit, are left out (and counted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from aihpc.perf.infer.kv import ServingPlan
from aihpc.perf.infer.serving import Load, ServingEstimate, steady_state
from aihpc.perf.step.params import ModelParams
from aihpc.runspec.cluster import ClusterSpec, GPUSpec
from aihpc.runspec.errors import SpecError
from aihpc.runspec.model import ModelSpec

__all__ = ["ServingSearch", "candidate_plans", "search_serving"]


@dataclass(frozen=True)
class ServingSearch:
    ranked: list[ServingEstimate]
    priced: int
    missed_target: int
    not_fitting: int

    def to_json(self, top: int = 10) -> dict[str, Any]:
        return {
            "priced": self.priced,
            "missed_target": self.missed_target,
            "not_fitting": self.not_fitting,
            "plans": [{"rank": i + 1, **p.to_json()} for i, p in enumerate(self.ranked[:top])],
        }


def _powers(limit: int) -> list[int]:
    out, x = [], 1
    while x <= limit:
        out.append(x)
        x *= 2
    return out


def candidate_plans(
    model: ModelSpec, gpu: GPUSpec, gpus: int, base: ServingPlan, kv_dtypes: tuple[str, ...]
) -> list[ServingPlan]:
    """Plans of at most ``gpus`` GPUs: tp a power of two within the NVLink domain dividing the
    heads, pp a power of two, attention dp x ep for MoE models (ep = tp x dp: every GPU of a
    stage holds experts)."""
    out = []
    domain = min(gpu.scale_up_domain, gpus)
    for tp in _powers(domain):
        if model.num_attention_heads % tp:
            continue
        for pp in _powers(min(gpus // tp, 16)):
            if pp > model.num_layers:
                continue
            dps = _powers(gpus // (tp * pp)) if model.is_moe else [1]
            for dp in dps:
                eps = {1, tp * dp} if model.is_moe else {1}
                for ep in sorted(eps):
                    if model.is_moe and ep > model.num_experts:
                        continue
                    for kv in kv_dtypes:
                        out.append(replace(base, tp=tp, pp=pp, dp=dp, ep=ep, kv_dtype=kv))
    return out


def _meets(est: ServingEstimate, tpot_s: float | None, ttft_s: float | None) -> bool:
    return (tpot_s is None or est.tpot_s <= tpot_s) and (ttft_s is None or est.ttft_s <= ttft_s)


def _best_at_target(
    model: ModelSpec,
    gpu: GPUSpec | ClusterSpec,
    plan: ServingPlan,
    load: Load,
    tpot_s: float | None,
    ttft_s: float | None,
    params: ModelParams | None,
) -> ServingEstimate | None:
    """The plan at the most sequences in flight that meets the targets (None: none does)."""
    full = steady_state(model, gpu, plan, load, params)
    if _meets(full, tpot_s, ttft_s):
        return full
    lo, hi = 1, full.batch
    best = None
    while lo <= hi:  # TPOT and TTFT grow with the batch
        mid = (lo + hi) // 2
        est = steady_state(model, gpu, plan, load, params, batch=mid)
        if _meets(est, tpot_s, ttft_s):
            best, lo = est, mid + 1
        else:
            hi = mid - 1
    return best


def search_serving(
    model: ModelSpec,
    gpu: GPUSpec | ClusterSpec,
    gpus: int,
    load: Load,
    base: ServingPlan,
    *,
    tpot_ms: float | None = None,
    ttft_ms: float | None = None,
    kv_dtypes: tuple[str, ...] | None = None,
    params: ModelParams | None = None,
) -> ServingSearch:
    """Plans of at most ``gpus`` GPUs meeting the targets, best tokens/s per GPU first."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise SpecError("--gpus", gpus, "a whole number >= 1")
    part = gpu.gpu if isinstance(gpu, ClusterSpec) else gpu
    kinds = kv_dtypes or tuple(dict.fromkeys((base.kv_dtype, "fp8")))
    tpot_s = tpot_ms / 1e3 if tpot_ms else None
    ttft_s = ttft_ms / 1e3 if ttft_ms else None
    ranked, missed, unfit, priced = [], 0, 0, 0
    for plan in candidate_plans(model, part, gpus, base, kinds):
        priced += 1
        try:
            est = _best_at_target(model, gpu, plan, load, tpot_s, ttft_s, params)
        except SpecError:  # the weights leave no KV cache on this plan
            unfit += 1
            continue
        if est is None:
            missed += 1
        else:
            ranked.append(est)
    ranked.sort(key=lambda e: (-e.tokens_per_s_per_gpu, e.plan.gpus))
    return ServingSearch(ranked, priced, missed, unfit)


def instances_on(gpus: int, plan: ServingPlan) -> int:
    """Whole instances of ``plan`` on ``gpus`` GPUs."""
    return max(1, math.floor(gpus / plan.gpus))
