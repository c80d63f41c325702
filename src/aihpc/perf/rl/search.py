"""The search over an RL step's layouts: placement (colocated, or disaggregated with each split
of whole nodes between the pools), the rollout engines' tensor (and expert) parallelism and the
training plan (the step search's best plans on the training pool, perf/search), each priced by
step.py; colocated under one of verl's offloads, also with the training state kept on the GPUs
(``rl.offload = "none"``, verl's default, where it fits beside the engine)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from aihpc.perf.rl.phases import packed_model
from aihpc.perf.rl.step import RLEstimate, estimate_rl
from aihpc.perf.search.ranking import search_plans
from aihpc.runspec.errors import SpecError
from aihpc.runspec.parallel import ParallelPlan
from aihpc.runspec.rl import RLSpec
from aihpc.runspec.runspec import RunSpec

__all__ = ["RLSearch", "search_rl"]


@dataclass(frozen=True)
class RLSearch:
    # the fastest training plan of each placement, rollout pool and engine layout, fastest first
    ranked: list[RLEstimate]
    evaluated: int
    refused: int  # layouts that broke a rule or did not fit


def _splits(spec: RunSpec) -> list[RLSpec]:
    """The placements to price: colocated (when the spec is on-policy) and every split of
    whole nodes (or, on one node, of halves and quarters) with the spec's staleness."""
    rl, cluster = spec.rl, spec.cluster
    assert rl is not None
    out = []
    if not rl.staleness:
        colocated = replace(rl, placement="colocated", rollout_gpus=0, weight_sync="auto")
        out.append(colocated)
        if rl.offload.startswith("verl-"):  # verl may keep the state on the GPUs (its default)
            out.append(replace(colocated, offload="none"))
    n, per = cluster.num_gpus, cluster.gpus_per_node
    unit = per if n > per else max(1, n // 4)
    for rollout in range(unit, n, unit):
        out.append(replace(rl, placement="disaggregated", rollout_gpus=rollout, weight_sync="auto"))
    return out


def _rollout_layouts(spec: RunSpec) -> list[tuple[int, int]]:
    """(tp, ep) of a rollout engine inside one NVLink domain: tp powers of two; an MoE model's
    experts also spread over the engine's GPUs (ep = tp, vLLM's --enable-expert-parallel)."""
    model, cluster = spec.model, spec.cluster
    out, tp = [], 1
    while tp <= min(cluster.nvlink_domain, model.num_attention_heads):
        out.append((tp, 1))
        if model.is_moe and 1 < tp <= model.num_experts:
            out.append((tp, tp))
        tp *= 2
    return out


def _training_plans(spec: RunSpec, rl: RLSpec, top: int) -> list[ParallelPlan]:
    """The step search's ``top`` plans on the training pool for sequences of a full packed bin,
    padded so that every tensor-parallel degree the search offers (powers of two within the
    scale-up domain, or the spec's own) splits it under sequence parallelism: a bin of 150 +
    8,192 tokens would otherwise rule out tp 4 and 8."""
    trial = replace(spec, rl=rl)
    cluster = trial.training_cluster()
    given = spec.parallel.given()
    probe = ParallelPlan(
        tp=given.get("tp", min(cluster.nvlink_domain, cluster.num_gpus)),
        cp=given.get("cp", 1),
        global_batch_size=spec.parallel.global_batch_size or 1,
    )
    model = packed_model(spec.model, rl, probe)
    found = search_plans(model, cluster, spec.parallel, spec.training, top=top)
    return [e.plan for e in found.plans if e.fits][:top]


def search_rl(spec: RunSpec, top_plans: int = 3) -> RLSearch:
    """Every placement x rollout tp x the step search's best training plans, priced; the
    fastest plan of each placement and rollout tp, fastest first."""
    if spec.rl is None:
        raise SpecError("rl", None, "required: an [rl] table (docs/rl.md)")
    ranked, evaluated, refused = [], 0, 0
    for placed in _splits(spec):
        try:
            plans = _training_plans(spec, placed, top_plans)
        except SpecError:
            refused += 1
            continue
        for tp, ep in _rollout_layouts(spec):
            rl = replace(placed, rollout=replace(placed.rollout, tp=tp, ep=ep))
            for plan in plans:
                evaluated += 1
                try:
                    trial = replace(spec, rl=rl)
                    trial.__post_init__()  # the pool and batch rules of a run spec
                    est = estimate_rl(trial, plan)
                except SpecError:
                    refused += 1
                    continue
                if est.fits:
                    ranked.append(est)
                else:
                    refused += 1
    best: dict[tuple, RLEstimate] = {}
    for est in ranked:
        key = (
            est.rl.placement,
            est.rollout_gpus,
            est.rl.rollout.tp,
            est.rl.rollout.ep,
            est.rl.offload,
        )
        if key not in best or est.step_time_s < best[key].step_time_s:
            best[key] = est
    return RLSearch(sorted(best.values(), key=lambda e: e.step_time_s), evaluated, refused)
