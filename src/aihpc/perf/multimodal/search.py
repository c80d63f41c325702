"""The search over a vision-language run's plans and encoder placements.

The language model's plans come from the step model's search (perf/search, every valid
completion of ``[parallel]`` priced as arrays, at the layout's sequence length); its best
``candidates`` that fit are then priced with the encoder at every placement the spec allows
(``multimodal.placement = "auto"``: all five), the encoder's own TP for a stage or a pool among
1, 2, 4 and 8 (what divides the node), and pools of the GPUs that fewer language-model replicas
leave (``placement_options``). Ranked by samples per second per GPU of the whole cluster
among those that fit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from aihpc.perf.multimodal.estimate import VlmEstimate, estimate_vlm
from aihpc.perf.multimodal.workload import layout
from aihpc.perf.search.ranking import search_plans
from aihpc.perf.step.params import DEFAULT_PARAMS, ModelParams
from aihpc.runspec.errors import SpecError
from aihpc.runspec.parallel import ParallelPlan
from aihpc.runspec.runspec import RunSpec
from aihpc.runspec.vision import PLACEMENTS

__all__ = ["VlmSearch", "placement_options", "search_vlm"]


@dataclass(frozen=True)
class VlmSearch:
    plans: list[VlmEstimate]  # best first, those that fit
    priced: int  # (plan, placement) pairs priced
    llm_plans: int  # language-model plans the step model's search evaluated
    best_by_placement: dict[str, VlmEstimate]

    def to_json(self, top: int | None = None) -> dict[str, Any]:
        return {
            "plans": [e.to_json() for e in self.plans[:top]],
            "priced": self.priced,
            "llm_plans_evaluated": self.llm_plans,
            "best_by_placement": {k: v.to_json() for k, v in self.best_by_placement.items()},
        }


def placement_options(
    spec: RunSpec, placements: tuple[str, ...], plan: ParallelPlan
) -> list[tuple[str, int, int]]:
    """(placement, encoder TP, pool GPUs) to price with ``plan``; 0 means the placement's own.
    A pool takes the GPUs that fewer language-model replicas leave (replicas that divide the
    batch, so that no GPU idles), at most half the cluster, the three smallest such pools."""
    mm = spec.multimodal
    assert mm is not None
    node = spec.cluster.gpus_per_node
    tps = [mm.encoder_tp] if mm.encoder_tp else [t for t in (1, 2, 4, 8) if node % t == 0]
    n = spec.cluster.num_gpus
    if mm.encoder_gpus:
        pools = [mm.encoder_gpus]
    else:
        mp = plan.tp * plan.pp * plan.cp
        per_step = plan.global_batch_size // plan.micro_batch_size
        sizes = {n - d * mp for d in range(1, n // mp + 1) if per_step % d == 0}
        pools = sorted(g for g in sizes if 0 < g <= n // 2)[:3]
    out: list[tuple[str, int, int]] = []
    for where in placements:
        if where in ("replicated", "tp", "bubble"):
            out.append((where, 0, 0))
        elif where == "stage":
            out += [(where, t, 0) for t in tps]
        else:
            out += [(where, t, g) for t in tps for g in pools if g % t == 0]
    return out


def search_vlm(
    spec: RunSpec,
    top: int | None = 10,
    candidates: int = 24,
    params: ModelParams = DEFAULT_PARAMS,
) -> VlmSearch:
    """The best plans of a vision-language run spec, each with its encoder's placement."""
    mm, v = spec.multimodal, spec.vision
    if mm is None or v is None:
        raise SpecError("model.vision", None, "a vision-language model needs [model.vision]")
    placements = PLACEMENTS if mm.placement == "auto" else (mm.placement,)
    mbs = spec.parallel.micro_batch_size or 1
    model = replace(spec.model, seq_length=layout(spec.model, v, mm, mbs).llm_seq)
    llm = search_plans(model, spec.cluster, spec.parallel, spec.training, candidates, params)
    priced: list[VlmEstimate] = []
    count = 0
    for est in llm.plans:
        for where, e_tp, gpus in placement_options(spec, placements, est.plan):
            count += 1
            try:
                got = estimate_vlm(spec, est.plan, where, e_tp or None, gpus or None, params)
            except SpecError:
                continue  # a placement this plan cannot take (gbs, pp = 1 for bubble)
            if got.fits:
                priced.append(got)
    priced.sort(key=lambda e: -e.samples_per_s_per_gpu)
    best: dict[str, VlmEstimate] = {}
    for e in priced:
        best.setdefault(e.placement, e)
    return VlmSearch(priced[:top] if top else priced, count, llm.evaluated, best)
