"""The search as it was before it priced plans as arrays (aihpc 21, item 2): one ParallelPlan
and one estimate_plan call per plan. Kept as the reference test_search_fast.py compares the
array search with, at test time.

Search every valid plan: enumerate the free [parallel] fields under the divisibility rules real
frameworks enforce, estimate each, prune what does not fit (keeping the reason), rank by
tokens/s/GPU (or by goodput-adjusted throughput).
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from aihpc.perf.step.estimate import Estimate, estimate_plan
from aihpc.perf.step.memory import GiB, activation_bytes_per_layer
from aihpc.perf.step.params import DEFAULT_PARAMS, ModelParams
from aihpc.runspec.cluster import ClusterSpec
from aihpc.runspec.errors import SpecError
from aihpc.runspec.model import ModelSpec
from aihpc.runspec.parallel import RECOMPUTE, ParallelPlan, PartialPlan, plan_problem
from aihpc.runspec.runspec import RunSpec
from aihpc.runspec.training import TrainingSpec

__all__ = ["Rejected", "SearchResult", "candidate_plans", "search"]

MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)
MAX_VPP = 8


@dataclass(frozen=True)
class Rejected:
    estimate: Estimate
    reason: str


@dataclass
class SearchResult:
    plans: list[Estimate]
    evaluated: int
    feasible: int
    elapsed_s: float
    rejected_best: list[Rejected] = field(default_factory=list)
    invalid_reasons: Counter[str] = field(default_factory=Counter)
    # The first refusal of each field, with its rule: what to say when no plan is valid at all
    invalid_examples: dict[str, SpecError] = field(default_factory=dict)

    def refusal(self) -> SpecError | None:
        """When no combination passed the divisibility rules: the most frequent rule's refusal
        (an expert-parallel rule, say), so the answer names it instead of "no plan fits"."""
        if self.evaluated or not self.invalid_examples:
            return None
        for name, _ in self.invalid_reasons.most_common():
            if name in self.invalid_examples:
                return self.invalid_examples[name]
        return None

    def to_json(self, top: int | None = None) -> dict:
        plans = self.plans if top is None else self.plans[:top]
        return {
            "plans": [e.to_json() for e in plans],
            "evaluated": self.evaluated,
            "feasible": self.feasible,
            "elapsed_s": self.elapsed_s,
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pow2_upto(n: int) -> list[int]:
    out, x = [], 1
    while x <= n:
        out.append(x)
        x *= 2
    return out


def candidate_plans(
    model: ModelSpec,
    cluster: ClusterSpec,
    partial: PartialPlan,
    invalid: Counter[str] | None = None,
    examples: dict[str, SpecError] | None = None,
) -> Iterator[ParallelPlan]:
    """Every complete plan consistent with the given fields that passes ``plan_problem``."""
    g = partial.given()
    if "global_batch_size" not in g:
        raise SpecError(
            "parallel.global_batch_size", None, "required for search: sequences per optimizer step"
        )
    n = cluster.num_gpus
    gbs = g["global_batch_size"]
    tps = (
        [g["tp"]]
        if "tp" in g
        else [
            x
            for x in _pow2_upto(min(cluster.nvlink_domain, n))
            if model.num_attention_heads % x == 0
        ]
    )
    # Stages may be uneven (the busiest one sets the pace), so powers of two are offered too.
    pps = (
        [g["pp"]]
        if "pp" in g
        else sorted(
            {x for x in _divisors(model.num_layers) + _pow2_upto(model.num_layers) if x <= n}
        )
    )
    cps = (
        [g["cp"]]
        if "cp" in g
        else [x for x in _pow2_upto(n) if x == 1 or model.seq_length % (2 * x) == 0]
    )
    zeros = [g["zero_stage"]] if "zero_stage" in g else [0, 1, 2, 3]
    recs = [g["recompute"]] if "recompute" in g else list(RECOMPUTE)
    mbss = [g["micro_batch_size"]] if "micro_batch_size" in g else list(MICRO_BATCH_SIZES)
    # Mixture of experts: expert parallel degrees that split the experts evenly (powers of two,
    # as the published recipes use), expert TP 1 or tp (Megatron-Core's default). With ep > 1
    # the 1F1B all-to-all overlap is offered, not "none": hiding part of the all-to-all never
    # costs more than the penalty of the part it hides (as sequence parallel, a dominated choice
    # is not enumerated; fix moe_a2a_overlap = "none" to price a framework without it).
    # DualPipe only when the run spec names it.
    for tp, pp, cp in itertools.product(tps, pps, cps):
        mp = tp * pp * cp
        if n % mp:
            continue
        dp = n // mp
        if "dp" in g and g["dp"] != dp:
            continue
        if "vpp" in g:
            vpps = [g["vpp"]]
        elif pp > 1:
            # Model chunks may be uneven, as torchtitan and Llama 3's stack run them (126 layers
            # on 8 x 2 or 16 x V chunks); the busiest chunk is priced. A V whose chunks would
            # leave the busiest stage more layers than plain 1F1B's is not offered: a larger V
            # without that excess has both less compute and a smaller bubble. With
            # training.pipeline_split = "even" (Megatron) search() keeps only equal chunks.
            busiest = -(-model.num_layers // pp)
            vpps = [
                v
                for v in range(1, MAX_VPP + 1)
                if pp * v <= model.num_layers and -(-model.num_layers // (pp * v)) * v == busiest
            ]
        else:
            vpps = [1]
        # Sequence parallel moves the same bytes as plain TP (all-gather + reduce-scatter = one
        # all-reduce) and strictly lowers activation memory and norm/dropout work, so a plan
        # without it is never better: only SP plans are enumerated unless the field is fixed.
        sps = [g["sequence_parallel"]] if "sequence_parallel" in g else [tp > 1]
        if "ep" in g:
            eps = [g["ep"]]
        elif model.is_moe:
            eps = [x for x in _pow2_upto(min(model.num_experts, tp * cp * dp))]
        else:
            eps = [1]
        etps = [g["etp"]] if "etp" in g else sorted({1, tp}) if model.is_moe else [1]
        moe = [
            (ep, etp, a2a)
            for ep, etp in itertools.product(eps, etps)
            for a2a in (
                [g["moe_a2a_overlap"]] if "moe_a2a_overlap" in g else ["1f1b" if ep > 1 else "none"]
            )
        ]
        for vpp, sp, zero, rec, mbs, (ep, etp, a2a) in itertools.product(
            vpps, sps, zeros, recs, mbss, moe
        ):
            if gbs % (dp * mbs):
                if invalid is not None:
                    invalid["global batch not divisible by dp x micro_batch_size"] += 1
                continue
            plan = ParallelPlan(
                tp=tp,
                pp=pp,
                vpp=vpp,
                cp=cp,
                dp=dp,
                ep=ep,
                etp=etp,
                moe_a2a_overlap=a2a,
                sequence_parallel=sp,
                zero_stage=zero,
                recompute=rec,
                micro_batch_size=mbs,
                global_batch_size=gbs,
                offload_layers=g.get("offload_layers", 0),
                # Changed on purpose: a given schedule and HSDP shard group are carried into
                # the searched plans (the search dropped them before).
                pp_schedule=g.get("pp_schedule"),
                dp_shard=g.get("dp_shard"),
                recompute_modules=tuple(g.get("recompute_modules", ())),
            )
            problem = plan_problem(plan, model, cluster)
            if problem is not None:
                if invalid is not None:
                    invalid[problem.field] += 1
                if examples is not None:
                    examples.setdefault(problem.field, problem)
                continue
            yield plan


def _offload_to_fit(
    model: ModelSpec,
    cluster: ClusterSpec,
    est: Estimate,
    training: TrainingSpec,
    params: ModelParams,
    memo: dict[tuple, Any],
) -> Estimate | None:
    """The plan with the fewest offloaded layers that fits GPU memory, or None where offloading
    cannot apply (pipeline parallelism, full recompute) or cannot make it fit."""
    plan = est.plan
    if plan.pp > 1 or plan.recompute == "full":
        return None
    excess = est.memory.total - est.hbm_gib * GiB
    # Every resident layer also carries the allocator's fragmentation share (memory.py).
    per_layer = activation_bytes_per_layer(model, plan, training)
    per_layer *= 1 + params.allocator_fragmentation
    k = math.ceil(excess / per_layer)
    if k < 1 or model.num_layers - k < 2:
        return None  # the double buffer keeps two layers on the GPU whatever is offloaded
    best = estimate_plan(
        model, cluster, replace(plan, offload_layers=k), training, params, check=False, memo=memo
    )
    return best if best.fits else None


def search(
    spec: RunSpec,
    top: int | None = None,
    params: ModelParams = DEFAULT_PARAMS,
    key: Callable[[Estimate], float] | None = None,
    progress: Callable[[int], None] | None = None,
    explain: int = 0,
) -> SearchResult:
    """Estimate every valid completion of ``spec.parallel``; best first among those that fit."""
    return search_plans(
        spec.model, spec.cluster, spec.parallel, spec.training, top, params, key, progress, explain
    )


def search_plans(
    model: ModelSpec,
    cluster: ClusterSpec,
    partial: PartialPlan,
    training: TrainingSpec,
    top: int | None = None,
    params: ModelParams = DEFAULT_PARAMS,
    key: Callable[[Estimate], float] | None = None,
    progress: Callable[[int], None] | None = None,
    explain: int = 0,
) -> SearchResult:
    key = key or (lambda e: e.tokens_per_s_per_gpu)
    start = time.perf_counter()
    invalid: Counter[str] = Counter()
    examples: dict[str, SpecError] = {}
    fitting: list[Estimate] = []
    rejected: list[Rejected] = []
    evaluated = 0
    per_tensor = training.zero3_gather == "per_tensor"
    even = training.pipeline_split == "even"
    memo: dict[tuple, Any] = {}
    # A plan that does not fit may offload activations instead (the fewest layers that make it
    # fit), unless the run spec fixes offload_layers or the GPU has no host-link figure.
    auto_offload = partial.offload_layers is None and cluster.gpu.host_link_GBps is not None
    for plan in candidate_plans(model, cluster, partial, invalid, examples):
        if per_tensor and plan.zero_stage == 3 and plan.pp > 1:
            invalid["training.zero3_gather (per-tensor ZeRO-3 has no pipelining)"] += 1
            continue
        if even and model.num_layers % (plan.pp * plan.vpp):
            invalid["training.pipeline_split (even chunks: pp x vpp must divide the layers)"] += 1
            continue
        est = estimate_plan(model, cluster, plan, training, params, check=False, memo=memo)
        evaluated += 1
        if progress is not None and evaluated % 256 == 0:
            progress(evaluated)
        if not est.fits and auto_offload:
            offloaded = _offload_to_fit(model, cluster, est, training, params, memo)
            if offloaded is not None:
                evaluated += 1
                est = offloaded
        if est.fits:
            fitting.append(est)
        elif explain:
            rejected.append(Rejected(est, est.bottleneck))
    fitting.sort(key=key, reverse=True)
    best_key = key(fitting[0]) if fitting else 0.0
    rejected = sorted(
        (r for r in rejected if key(r.estimate) > best_key),
        key=lambda r: key(r.estimate),
        reverse=True,
    )[:explain]
    return SearchResult(
        plans=fitting[:top] if top else fitting,
        evaluated=evaluated,
        feasible=len(fitting),
        elapsed_s=time.perf_counter() - start,
        rejected_best=rejected,
        invalid_reasons=invalid,
        invalid_examples=examples,
    )
