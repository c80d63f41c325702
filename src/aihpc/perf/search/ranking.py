"""Search every valid plan: enumerate the free [parallel] fields under the divisibility rules real
frameworks enforce, estimate each, prune what does not fit (keeping the reason), rank by
tokens/s/GPU (or by goodput-adjusted throughput).

The plans are priced as numpy arrays (``candidates.candidate_batch``, ``batch.price_batch``):
tens of thousands in a few tens of milliseconds. The plans a caller sees (the ranked ones, the
rejected ones of ``explain``) are then estimated one by one with ``estimate_plan``, so every
figure printed is the single-plan estimate's.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aihpc.perf.search.candidates import (
    GBS_RULE,
    MAX_VPP,
    MICRO_BATCH_SIZES,
    candidate_batch,
    count_refusals,
    first_problem,
    plan_problems,
)
from aihpc.perf.step.batch import FULL, BatchTimes, PlanBatch, price_batch
from aihpc.perf.step.estimate import Estimate, estimate_plan
from aihpc.perf.step.memory import GiB
from aihpc.perf.step.params import DEFAULT_PARAMS, ModelParams
from aihpc.runspec.cluster import ClusterSpec
from aihpc.runspec.errors import SpecError
from aihpc.runspec.model import ModelSpec
from aihpc.runspec.parallel import ParallelPlan, PartialPlan
from aihpc.runspec.rules import trainer_plan_rule
from aihpc.runspec.runspec import RunSpec
from aihpc.runspec.training import TrainingSpec

__all__ = ["Rejected", "SearchResult", "candidate_plans", "search"]

__all__ += ["MAX_VPP", "MICRO_BATCH_SIZES", "search_plans"]
PER_TENSOR_RULE = "training.zero3_gather (per-tensor ZeRO-3 has no pipelining)"
EVEN_RULE = "training.pipeline_split (even chunks: pp x vpp must divide the layers)"


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


def candidate_plans(
    model: ModelSpec,
    cluster: ClusterSpec,
    partial: PartialPlan,
    invalid: Counter[str] | None = None,
    examples: dict[str, SpecError] | None = None,
) -> Iterator[ParallelPlan]:
    """Every complete plan consistent with the given fields that passes ``plan_problem``."""
    batch, _ = _valid_batch(model, cluster, partial, None, invalid, examples)
    for i in range(len(batch)):
        yield batch.plan(i)


def _valid_batch(
    model: ModelSpec,
    cluster: ClusterSpec,
    partial: PartialPlan,
    training: TrainingSpec | None,
    invalid: Counter[str] | None,
    examples: dict[str, SpecError] | None,
    runnable: bool = False,
) -> tuple[PlanBatch, int]:
    """The candidates that pass every rule (and, given ``training``, the search's own two), with
    each refusal counted; and how many combinations were refused."""
    full = candidate_batch(model, cluster, partial, runnable)
    rules = [(GBS_RULE, full.global_batch_size % (full.dp * full.mbs) != 0)]
    rules += plan_problems(full, model, cluster)
    with_example = {name for name, _ in rules[1:]}
    if training is not None:
        per_tensor = training.zero3_gather == "per_tensor"
        rules.append((PER_TENSOR_RULE, (full.zero == 3) & (full.pp > 1) & per_tensor))
        if training.pipeline_split == "even":
            rules.append((EVEN_RULE, model.num_layers % (full.pp * full.vpp) != 0))
    reasons, names = first_problem(rules, len(full))
    if invalid is not None:
        count_refusals(
            full,
            reasons,
            names,
            model,
            cluster,
            invalid,
            {} if examples is None else examples,
            with_example,
        )
    ok = np.nonzero(reasons < 0)[0]
    return full.take(ok), len(full) - len(ok)


Accept = Callable[[ParallelPlan], "SpecError | None"]


def _both(first: Accept | None, second: Accept) -> Accept:
    """A plan refused by either rule set, the first's refusal first."""
    if first is None:
        return second
    return lambda plan: first(plan) or second(plan)


def _refusals(b: PlanBatch, accept: Accept) -> list[SpecError | None]:
    """``accept``'s answer for each plan of ``b``, asked once per distinct plan (the global
    batch is the same for all of them)."""
    cols = np.stack([b.tp, b.pp, b.vpp, b.cp, b.dp, b.ep, b.etp, b.sp, b.zero, b.rec, b.a2a,
                     b.offload, b.mbs], axis=1)  # fmt: skip
    if not len(cols):
        return []
    _, first, inverse = np.unique(cols, axis=0, return_index=True, return_inverse=True)
    answers = [accept(b.plan(int(i))) for i in first]
    return [answers[k] for k in inverse.reshape(-1).tolist()]


def _accepted(
    b: PlanBatch, accept: Accept, invalid: Counter[str], examples: dict[str, SpecError]
) -> PlanBatch:
    """The plans ``accept`` takes; each refusal counted under the field it names."""
    answers = _refusals(b, accept)
    for err in answers:
        if err is not None:
            invalid[err.field] += 1
            examples.setdefault(err.field, err)
    return b.take(np.array([i for i, err in enumerate(answers) if err is None], dtype=np.int64))


def _offload_to_fit(
    model: ModelSpec,
    cluster: ClusterSpec,
    b: PlanBatch,
    times: BatchTimes,
    training: TrainingSpec,
    params: ModelParams,
) -> tuple[np.ndarray, BatchTimes | None, PlanBatch | None]:
    """For the plans that do not fit: the fewest offloaded layers that make each fit GPU memory
    (0 where offloading cannot apply: pipeline parallelism, full recompute, or the double buffer
    would leave under two layers on the GPU), and the priced offloaded plans."""
    excess = times.memory_total - cluster.usable_hbm_gib * GiB
    # Every resident layer also carries the allocator's fragmentation share (memory.py).
    per_layer = times.act_layer * (1 + params.allocator_fragmentation)
    can = ~times.fits & (b.pp == 1) & (b.rec != FULL)
    k = np.where(can, np.ceil(excess / np.where(can, per_layer, 1.0)), 0).astype(np.int64)
    k = np.where((k >= 1) & (model.num_layers - k >= 2), k, 0)
    tried = np.nonzero(k)[0]
    if not len(tried):
        return tried, None, None
    sub = b.take(tried).with_offload(k[tried])
    return tried, price_batch(model, cluster, sub, training, params), sub


def search(
    spec: RunSpec,
    top: int | None = None,
    params: ModelParams = DEFAULT_PARAMS,
    key: Callable[[Estimate], float] | None = None,
    progress: Callable[[int], None] | None = None,
    explain: int = 0,
    weight: Callable[[float], float] | None = None,
    accept: Accept | None = None,
    runnable: bool = False,
) -> SearchResult:
    """Estimate every valid completion of ``spec.parallel``; best first among those that fit.

    Ranked by tokens/s/GPU; by that times ``weight(step time)`` (goodput: throughput x ETTR,
    over the arrays of plans), or by ``key`` of each plan's estimate (every plan estimated on
    its own: slower). ``accept`` keeps the search inside what a framework runs: the SpecError
    naming what it refuses in a plan, None where it runs it (the CLI passes the framework's
    rules from aihpc.interop, which perf may not import). ``runnable``: only the plans aihpc's
    own trainer runs (``aihpc.runspec.rules``), its MoE options offered where the spec leaves
    them free."""
    return search_plans(
        spec.model,
        spec.cluster,
        spec.parallel,
        spec.training,
        top,
        params,
        key,
        progress,
        explain,
        weight,
        accept,
        runnable,
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
    weight: Callable[[float], float] | None = None,
    accept: Accept | None = None,
    runnable: bool = False,
) -> SearchResult:
    start = time.perf_counter()
    invalid: Counter[str] = Counter()
    examples: dict[str, SpecError] = {}
    if runnable:
        accept = _both(accept, trainer_plan_rule(model, training, cluster.num_gpus))
    batch, _ = _valid_batch(model, cluster, partial, training, invalid, examples, runnable)
    if accept is not None:
        batch = _accepted(batch, accept, invalid, examples)
    times = price_batch(model, cluster, batch, training, params)
    evaluated = len(batch)
    fits, score = times.fits.copy(), times.tokens_per_s_per_gpu.copy()
    step = times.step_time_s.copy()
    offload = batch.offload.copy()
    # A plan that does not fit may offload activations instead (the fewest layers that make it
    # fit), unless the run spec fixes offload_layers or the GPU has no host-link figure.
    if partial.offload_layers is None and cluster.gpu.host_link_GBps is not None:
        tried, moved, sub = _offload_to_fit(model, cluster, batch, times, training, params)
        if moved is not None and sub is not None and accept is not None:
            runs = np.array([e is None for e in _refusals(sub, accept)], dtype=bool)
            moved.fits[:] = moved.fits & runs  # offloading may be what the framework refuses
        if moved is not None and sub is not None:
            evaluated += int(moved.fits.sum())  # an offloaded plan that still fails is dropped
            ok = tried[moved.fits]
            fits[ok], score[ok] = True, moved.tokens_per_s_per_gpu[moved.fits]
            step[ok], offload[ok] = moved.step_time_s[moved.fits], sub.offload[moved.fits]
    batch = batch.with_offload(offload)
    if progress is not None:
        progress(evaluated)
    if weight is not None:  # a cheap scalar function of the step time, on the plans ranked
        ranked = np.nonzero(fits if not explain else np.ones_like(fits))[0]
        score = score.copy()
        score[ranked] *= np.fromiter(map(weight, step[ranked].tolist()), float, len(ranked))
    fitting, rejected = _rank(
        model, cluster, training, params, batch, fits, score, top, key, explain
    )
    return SearchResult(
        plans=fitting,
        evaluated=evaluated,
        feasible=int(fits.sum()),
        elapsed_s=time.perf_counter() - start,
        rejected_best=rejected,
        invalid_reasons=invalid,
        invalid_examples=examples,
    )


def _rank(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    params: ModelParams,
    batch: PlanBatch,
    fits: np.ndarray,
    score: np.ndarray,
    top: int | None,
    key: Callable[[Estimate], float] | None,
    explain: int,
) -> tuple[list[Estimate], list[Rejected]]:
    """The best ``top`` plans that fit, and the ``explain`` best that do not but look faster,
    each estimated one by one (``estimate_plan``: the figures a caller prints)."""
    memo: dict[tuple, Any] = {}

    def estimate(i: int) -> Estimate:
        plan = batch.plan(int(i))
        return estimate_plan(model, cluster, plan, training, params, check=False, memo=memo)

    fit_idx, bad_idx = np.nonzero(fits)[0], np.nonzero(~fits)[0]
    if key is None:  # tokens/s/GPU: ranked over the arrays, stable as a list sort
        order = fit_idx[np.argsort(-score[fit_idx], kind="stable")]
        fitting = [estimate(i) for i in (order[:top] if top else order)]
        best = score[order[0]] if len(order) else 0.0
        worse = bad_idx[score[bad_idx] > best] if explain else bad_idx[:0]
        worse = worse[np.argsort(-score[worse], kind="stable")][:explain]
        return fitting, [Rejected(e, e.bottleneck) for e in map(estimate, worse)]
    # any other ranking (goodput) needs every estimate
    fitting = sorted(map(estimate, fit_idx), key=key, reverse=True)
    best_key = key(fitting[0]) if fitting else 0.0
    others = [e for e in map(estimate, bad_idx) if key(e) > best_key] if explain else []
    rejected = [Rejected(e, e.bottleneck) for e in sorted(others, key=key, reverse=True)]
    return fitting[:top] if top else fitting, rejected[:explain]
