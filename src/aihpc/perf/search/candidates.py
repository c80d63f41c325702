"""Every plan the search considers, as columns of numpy arrays (``PlanBatch``), in the order the
search has always listed them, with the divisibility rules of ``plan_problem`` applied to all of
them at once.

The free [parallel] fields are enumerated under the rules real frameworks enforce (see
``candidate_batch``); ``plan_problems`` is ``plan_problem`` over arrays, and the refusal kept as an
example for each field is the one ``plan_problem`` itself gives for the first plan it refuses.
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np

from aihpc.perf.step.batch import FULL, OP, PlanBatch
from aihpc.runspec.cluster import ClusterSpec
from aihpc.runspec.errors import SpecError
from aihpc.runspec.model import ModelSpec
from aihpc.runspec.parallel import MOE_A2A_OVERLAPS, RECOMPUTE, PartialPlan, plan_problem
from aihpc.runspec.rules import TRAINER_A2A_OVERLAPS, trainer_etps

__all__ = ["GBS_RULE", "MAX_VPP", "MICRO_BATCH_SIZES", "candidate_batch", "plan_problems"]

MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)
MAX_VPP = 8
GBS_RULE = "global batch not divisible by dp x micro_batch_size"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pow2_upto(n: int) -> list[int]:
    out, x = [], 1
    while x <= n:
        out.append(x)
        x *= 2
    return out


def _axes(model: ModelSpec, cluster: ClusterSpec, g: dict) -> tuple[list, list, list]:
    """The tp, pp and cp degrees offered (a given field stays fixed)."""
    n = cluster.num_gpus
    heads = model.num_attention_heads
    tps = (
        [g["tp"]]
        if "tp" in g
        else [x for x in _pow2_upto(min(cluster.nvlink_domain, n)) if heads % x == 0]
    )
    # Stages may be uneven (the busiest one sets the pace), so powers of two are offered too.
    layers = model.num_layers
    pps = (
        [g["pp"]]
        if "pp" in g
        else sorted({x for x in _divisors(layers) + _pow2_upto(layers) if x <= n})
    )
    cps = (
        [g["cp"]]
        if "cp" in g
        else [x for x in _pow2_upto(n) if x == 1 or model.seq_length % (2 * x) == 0]
    )
    return tps, pps, cps


def _vpps(model: ModelSpec, g: dict, pp: int) -> list[int]:
    """Model chunks per rank offered for ``pp`` stages.

    Chunks may be uneven, as torchtitan and Llama 3's stack run them (126 layers on 8 x 2 or
    16 x V chunks); the busiest chunk is priced. A V whose chunks would leave the busiest stage
    more layers than plain 1F1B's is not offered: a larger V without that excess has both less
    compute and a smaller bubble. With training.pipeline_split = "even" (Megatron) the search
    keeps only equal chunks."""
    if "vpp" in g:
        return [g["vpp"]]
    if pp == 1:
        return [1]
    layers = model.num_layers
    busiest = -(-layers // pp)
    offered = [
        v
        for v in range(1, MAX_VPP + 1)
        if pp * v <= layers and -(-layers // (pp * v)) * v == busiest
    ]
    # More stages than layers: offer the plain schedule anyway, so the layer rule refuses it
    # by name instead of the search finding nothing and saying "no plan fits".
    return offered or [1]


def _moe_options(
    model: ModelSpec, g: dict, tp: int, ranks: int, runnable: bool = False
) -> list[tuple[int, int, int]]:
    """(ep, etp, a2a) offered. Expert parallel degrees that split the experts evenly (powers of
    two, as the published recipes use), expert TP 1 or tp (Megatron-Core's default). With ep > 1
    the 1F1B all-to-all overlap is offered, not "none": hiding part of the all-to-all never costs
    more than the penalty of the part it hides (as sequence parallel, a dominated choice is not
    enumerated; fix moe_a2a_overlap = "none" to price a framework without it). DualPipe only
    when the run spec names it. ``runnable``: the expert TP degrees and the overlap aihpc's own
    trainer runs (``aihpc.runspec.rules``) instead."""
    if "ep" in g:
        eps = [g["ep"]]
    elif model.is_moe:
        eps = _pow2_upto(min(model.num_experts, ranks))
    else:
        eps = [1]
    etps = [g["etp"]] if "etp" in g else sorted({1, tp}) if model.is_moe else [1]
    a2a_given = g.get("moe_a2a_overlap")
    if runnable and model.is_moe:
        etps = [g["etp"]] if "etp" in g else list(trainer_etps(tp))
        a2a_given = a2a_given or TRAINER_A2A_OVERLAPS[0]
    return [
        (ep, etp, MOE_A2A_OVERLAPS.index(a2a_given or ("1f1b" if ep > 1 else "none")))
        for ep, etp in itertools.product(eps, etps)
    ]


def candidate_batch(
    model: ModelSpec, cluster: ClusterSpec, partial: PartialPlan, runnable: bool = False
) -> PlanBatch:
    """Every combination of the free fields, before any divisibility rule, in search order:
    tp, pp, cp, then vpp, sequence parallel, ZeRO stage, recompute, micro-batch, (ep, etp, a2a);
    with ``runnable``, the MoE options aihpc's trainer has (``_moe_options``).

    Sequence parallel moves the same bytes as plain TP (all-gather + reduce-scatter = one
    all-reduce) and strictly lowers activation memory and norm/dropout work, so a plan without it
    is never better: only SP plans are enumerated unless the field is fixed."""
    g = partial.given()
    if "global_batch_size" not in g:
        raise SpecError(
            "parallel.global_batch_size", None, "required for search: sequences per optimizer step"
        )
    n = cluster.num_gpus
    tps, pps, cps = _axes(model, cluster, g)
    mids: list[tuple[int, int, int, int, int, bool]] = []
    moes: list[tuple[int, int, int]] = []
    counts: list[int] = []
    vpp_of = {pp: _vpps(model, g, pp) for pp in pps}
    for tp, pp, cp in itertools.product(tps, pps, cps):
        mp = tp * pp * cp
        if n % mp:
            continue
        dp = n // mp
        if "dp" in g and g["dp"] != dp:
            continue
        sps = [g["sequence_parallel"]] if "sequence_parallel" in g else [tp > 1]
        moe = _moe_options(model, g, tp, tp * cp * dp, runnable)
        for vpp, sp in itertools.product(vpp_of[pp], sps):
            mids.append((tp, pp, cp, dp, vpp, sp))
            moes.extend(moe)
            counts.append(len(moe))
    zeros = [g["zero_stage"]] if "zero_stage" in g else [0, 1, 2, 3]
    recs = [RECOMPUTE.index(g["recompute"])] if "recompute" in g else list(range(len(RECOMPUTE)))
    mbss = [g["micro_batch_size"]] if "micro_batch_size" in g else list(MICRO_BATCH_SIZES)
    return _expand(mids, moes, counts, (zeros, recs, mbss), g)


def _expand(
    mids: list[tuple[int, int, int, int, int, bool]],
    moes: list[tuple[int, int, int]],
    counts: list[int],
    inner: tuple[list[int], list[int], list[int]],
    g: dict,
) -> PlanBatch:
    """Each (tp, pp, cp, dp, vpp, sp) row times zero x recompute x micro-batch x its MoE options,
    the MoE options innermost."""
    zrb = len(inner[0]) * len(inner[1]) * len(inner[2])
    mid = np.array(mids, dtype=np.int64).reshape(-1, 6)
    k = np.array(counts, dtype=np.int64)
    per_mid = zrb * k
    rows = np.repeat(np.arange(len(mid)), per_mid)
    start = np.concatenate(([0], np.cumsum(per_mid)[:-1]))
    moe_start = np.concatenate(([0], np.cumsum(k)[:-1]))
    j = np.arange(len(rows)) - start[rows]
    k_r = k[rows]
    z_i, r_i, b_i = np.unravel_index(j // k_r, tuple(len(x) for x in inner))
    moe = np.array(moes, dtype=np.int64).reshape(-1, 3)[moe_start[rows] + j % k_r]
    col = mid[rows]
    return PlanBatch(
        tp=col[:, 0],
        pp=col[:, 1],
        vpp=col[:, 4],
        cp=col[:, 2],
        dp=col[:, 3],
        ep=moe[:, 0],
        etp=moe[:, 1],
        sp=col[:, 5].astype(bool),
        zero=np.array(inner[0], dtype=np.int64)[z_i],
        rec=np.array(inner[1], dtype=np.int64)[r_i],
        mbs=np.array(inner[2], dtype=np.int64)[b_i],
        a2a=moe[:, 2],
        offload=np.full(len(rows), g.get("offload_layers", 0), dtype=np.int64),
        global_batch_size=g["global_batch_size"],
        # A given pipeline schedule or HSDP shard group holds for every searched plan (the
        # search used to drop both: a "zbv" request came back as interleaved plans); plan
        # rules then keep only the plans it fits (zbv: vpp 2; interleaved: vpp > 1).
        pp_schedule=g.get("pp_schedule"),
        dp_shard=g.get("dp_shard"),
        recompute_modules=tuple(g.get("recompute_modules", ())),
    )


def plan_problems(
    b: PlanBatch, model: ModelSpec, cluster: ClusterSpec
) -> list[tuple[str, np.ndarray]]:
    """``plan_problem``'s rules over arrays, in its order: (field, mask of the plans that break
    the rule). A plan's problem is the first rule it breaks."""
    tp, pp, vpp, cp, dp = b.tp, b.pp, b.vpp, b.cp, b.dp
    seq, layers = model.seq_length, model.num_layers
    modules = b.recompute_modules
    zeros = np.zeros(len(b), dtype=bool)
    if b.pp_schedule is None:
        schedule_bad = zeros
    else:
        wanted = {"1f1b": vpp == 1, "interleaved-1f1b": vpp > 1, "zbv": vpp == 2}
        schedule_bad = np.where(pp == 1, b.pp_schedule != "1f1b", ~wanted[b.pp_schedule])
    if b.dp_shard is None:
        shard_bad = zeros
    else:
        shard_bad = (dp % b.dp_shard != 0) | ((b.zero == 0) & (b.dp_shard != dp))
    m = b.global_batch_size // (dp * b.mbs)
    rules = [
        ("parallel.dp", tp * pp * cp * dp != cluster.num_gpus),
        ("parallel.tp", model.num_attention_heads % tp != 0),
        ("parallel.tp", (model.kv_heads % tp != 0) & (tp % model.kv_heads != 0)),
        ("parallel.tp", model.ffn_hidden_size % tp != 0),
        ("parallel.sequence_parallel", b.sp & (tp == 1)),
        ("parallel.pp", pp * vpp > layers),
        ("parallel.vpp", (vpp > 1) & (pp == 1)),
        ("parallel.pp_schedule", schedule_bad),
        ("parallel.dp_shard", shard_bad),
        ("parallel.cp", (seq % (2 * cp) != 0) & (cp > 1)),
        ("parallel.tp", b.sp & ((seq // cp) % tp != 0)),
        ("parallel.recompute_modules", (b.rec == FULL) | (b.rec == OP) if modules else zeros),
        ("parallel.recompute_modules", zeros | ("mla_up_proj" in modules and not model.is_mla)),
        ("parallel.recompute_modules", zeros | ("moe_act" in modules and not model.is_moe)),
        *_moe_rules(b, model),
        ("parallel.global_batch_size", b.global_batch_size % (dp * b.mbs) != 0),
        *_offload_rules(b, model, cluster),
        ("parallel.vpp", (vpp > 1) & (b.pp_schedule != "zbv") & (m % pp != 0)),
    ]
    return rules


def _moe_rules(b: PlanBatch, model: ModelSpec) -> list[tuple[str, np.ndarray]]:
    dual = b.a2a == MOE_A2A_OVERLAPS.index("dualpipe")
    if not model.is_moe:
        return [
            ("parallel.ep", b.ep > 1),
            ("parallel.etp", b.etp > 1),
            ("parallel.moe_a2a_overlap", b.a2a != MOE_A2A_OVERLAPS.index("none")),
        ]
    attn = b.tp * b.cp * b.dp
    return [
        ("parallel.ep", model.num_experts % b.ep != 0),
        ("parallel.etp", model.expert_ffn_hidden_size % b.etp != 0),
        ("parallel.ep", attn % (b.etp * b.ep) != 0),
        ("parallel.sequence_parallel", (b.tp > 1) & ~b.sp),
        ("parallel.moe_a2a_overlap", dual & ((b.pp < 2) | (b.pp % 2 != 0) | (b.vpp > 1))),
    ]


def _offload_rules(
    b: PlanBatch, model: ModelSpec, cluster: ClusterSpec
) -> list[tuple[str, np.ndarray]]:
    on = b.offload > 0
    return [
        ("parallel.offload_layers", on & (b.offload >= model.num_layers)),
        ("parallel.offload_layers", on & (b.pp > 1)),
        ("parallel.offload_layers", on & (b.rec == FULL)),
        ("parallel.offload_layers", on & (cluster.gpu.host_link_GBps is None)),
    ]


def first_problem(rules: list[tuple[str, np.ndarray]], size: int) -> tuple[np.ndarray, list[str]]:
    """(each plan's first broken rule as an index into the names, -1 if none; the names)."""
    names = list(dict.fromkeys(name for name, _ in rules))
    out = np.full(size, -1, dtype=np.int64)
    for name, mask in rules:
        out = np.where((out < 0) & mask, names.index(name), out)
    return out, names


def count_refusals(
    b: PlanBatch,
    reasons: np.ndarray,
    names: list[str],
    model: ModelSpec,
    cluster: ClusterSpec,
    invalid: Counter[str],
    examples: dict[str, SpecError],
    with_example: set[str],
) -> None:
    """Count each rule's refusals, in the order the search first meets them, and keep the
    refusal ``plan_problem`` gives for the first plan each field refuses."""
    hit = np.nonzero(reasons >= 0)[0]
    if not len(hit):
        return
    codes, first, counts = np.unique(reasons[hit], return_index=True, return_counts=True)
    for code, i, count in sorted(zip(codes, first, counts, strict=True), key=lambda x: x[1]):
        name = names[int(code)]
        invalid[name] += int(count)
        if name in with_example and name not in examples:
            problem = plan_problem(b.plan(int(hit[i])), model, cluster)
            assert problem is not None and problem.field == name, (name, problem)
            examples[name] = problem
