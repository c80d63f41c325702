"""The figures of a plan that depend only on its (tp, cp, micro-batch, SP, ep, etp) shape (and,
under eager FSDP2 on a GPU, how many all-gathers its layer issues: fsdp_host.gather_class) --
kernel times, the tensor-parallel collective, the MoE dispatch, the context-parallel exchange,
the saved activations -- computed once per distinct shape by the scalar kernel-time (compute.py)
and collective (comm.py) functions, and gathered into arrays over the plans; for one plan
(``PlanBatch.of``) they are that plan's numbers, kept in the caller's memo when it passes one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from aihpc.perf.step import comm, compute, fsdp_host, tp_overlap
from aihpc.perf.step.memory import activation_bytes_per_layer
from aihpc.perf.step.moe_stack import stack_of
from aihpc.perf.step.params import ModelParams
from aihpc.perf.step.plan_batch import PlanBatch, group
from aihpc.runspec.cluster import ClusterSpec
from aihpc.runspec.model import ModelSpec
from aihpc.runspec.parallel import RECOMPUTE, ParallelPlan
from aihpc.runspec.training import TrainingSpec

__all__ = ["Shapes", "moe_comm_fwd_s"]


class Shapes:
    """Scalar figures of each distinct (tp, cp, micro-batch, SP, ep, etp) shape, as arrays over
    the plans. Computed by the same functions ``estimate_plan`` calls."""

    def __init__(
        self,
        b: PlanBatch,
        model: ModelSpec,
        cluster: ClusterSpec,
        training: TrainingSpec,
        params: ModelParams,
        memo: dict[tuple, Any] | None = None,
    ) -> None:
        self.model, self.cluster, self.training, self.params = model, cluster, training, params
        self.batch = b
        if b.one:
            self._one(b, memo)
            return
        gathers = np.asarray(fsdp_host.gather_class(b, training, cluster.gpu))
        gathers = np.broadcast_to(gathers, np.shape(b.tp)).astype(np.int64)
        first, inv = group(b.tp, b.cp, b.mbs, b.sp, b.ep, b.etp, gathers)
        self.first, self.inv = first, inv
        rows = [self._row(b.plan(int(i)), model, cluster, training, params) for i in first]
        self.cols = {k: np.array([r[k] for r in rows]) for k in rows[0] if k != "rec"}
        self.rec = np.array([r["rec"] for r in rows])  # shapes x RECOMPUTE
        self.act = np.array([r["act"] for r in rows])  # shapes x RECOMPUTE
        self.act_none = self.act[:, RECOMPUTE.index("none")]

    def _one(self, b: PlanBatch, memo: dict[tuple, Any] | None) -> None:
        """One plan's figures; its saved activations only when it offloads them."""
        offload = bool(b.offload)
        gathers = int(fsdp_host.gather_class(b, self.training, self.cluster.gpu))
        key = ("shape", b.tp, b.cp, b.mbs, b.sp, b.ep, b.etp, b.recompute_modules, offload)
        key += (gathers,)
        row = memo.get(key) if memo is not None else None
        if row is None:
            m, c, t, p = self.model, self.cluster, self.training, self.params
            row = self._row(b.plan(), m, c, t, p, with_act=offload)
            if memo is not None:
                memo[key] = row
        self.first = self.inv = None
        self.cols, self.rec, self.act = row, row["rec"], row["act"]

    def __getitem__(self, key: str) -> Any:
        return self.cols[key] if self.inv is None else self.cols[key][self.inv]

    def by_rec(self, table: Any, rec: Any) -> Any:
        """Each plan's entry of a shapes x RECOMPUTE table (``rec``: its recompute policy)."""
        return table[rec] if self.inv is None else table[self.inv, rec]

    @staticmethod
    def _row(
        plan: ParallelPlan,
        model: ModelSpec,
        cluster: ClusterSpec,
        training: TrainingSpec,
        params: ModelParams,
        with_act: bool = True,
    ) -> dict[str, Any]:
        gpu, cal = cluster.gpu, cluster.calibration
        moe_frac = model.num_moe_layers / model.num_layers if model.is_moe else 0.0
        lt = compute.layer_times(model, gpu, plan, training, params, cal)
        lt_moe = None
        if moe_frac:
            lt_moe = compute.layer_times(model, gpu, plan, training, params, cal, moe=True)
        lfwd, lbwd = compute.logits_time_s(model, gpu, plan, training, params, cal)
        if model.mtp_layers:
            lfwd, lbwd = (1 + model.mtp_layers) * lfwd, (1 + model.mtp_layers) * lbwd
        fwd, bwd, modules = _mix(lt, lt_moe, moe_frac)
        recs = []
        for rec in RECOMPUTE:
            if rec == "full":
                r = fwd
            elif rec == "selective":
                r = lt.fwd_attn
            elif rec == "op":
                r = lt.fwd_gemm_unsaved_op + lt.fwd_elementwise
            else:
                r = 0.0
            if plan.recompute_modules:
                r += modules
            recs.append(r)
        row = {
            "fwd": fwd,
            "bwd": bwd,
            "lfwd": lfwd,
            "lbwd": lbwd,
            "bwd_gemm": lt.bwd_gemm,
            "moe_fb": lt_moe.fwd + lt_moe.bwd if lt_moe is not None else 0.0,
            # the MoE layer's attention side and MoE block, forward and backward (moe_overlap.py)
            "moe_af": lt_moe.fwd - lt_moe.mlp_fwd if lt_moe is not None else 0.0,
            "moe_ab": lt_moe.bwd - lt_moe.mlp_bwd if lt_moe is not None else 0.0,
            "moe_mf": lt_moe.mlp_fwd if lt_moe is not None else 0.0,
            "moe_mb": lt_moe.mlp_bwd if lt_moe is not None else 0.0,
            "rec": recs,
            "act": [
                activation_bytes_per_layer(model, plan, training, recompute=r) for r in RECOMPUTE
            ]
            if with_act
            else None,
        }
        row.update(_shape_comm(plan, model, cluster, training, params, lt, moe_frac))
        return row

    def pp_hop(self, cross: Any) -> Any:
        """One pipeline send of each plan's activations, over NVLink or the network."""
        if self.inv is None:
            b = self.batch
            msg = self.cols["act_bytes"] / (b.tp if b.sp else 1)
            ctas = self.training.pp_comm_ctas
            return comm.p2p_time_s(self.cluster, msg, cross, self.params, channels=ctas)
        keys = self.inv * 2 + cross.astype(np.int64)
        uniq, inv = np.unique(keys, return_inverse=True)
        b, table = self.batch, np.empty(len(uniq))
        for j, key in enumerate(uniq.tolist()):
            i = int(self.first[key // 2])
            msg = self.cols["act_bytes"][key // 2] / (int(b.tp[i]) if b.sp[i] else 1)
            table[j] = comm.p2p_time_s(
                self.cluster, msg, bool(key % 2), self.params, channels=self.training.pp_comm_ctas
            )
        return table[inv]


def _mix(lt: Any, lt_moe: Any, moe_frac: float) -> tuple[float, float, float]:
    """A layer's forward, backward and recompute-module times, mixed over dense and MoE layers."""
    if moe_frac:
        fwd = (1 - moe_frac) * lt.fwd + moe_frac * lt_moe.fwd
        bwd = (1 - moe_frac) * lt.bwd + moe_frac * lt_moe.bwd
        modules = (1 - moe_frac) * lt.fwd_modules + moe_frac * lt_moe.fwd_modules
        return fwd, bwd, modules
    return lt.fwd, lt.bwd, lt.fwd_modules


# One layer's TP terms of a shape (batch_shapes.tp_layer_s), in its order.
TP_TERMS = ("tp_fwd_x", "tp_fwd_h", "tp_bwd_x", "tp_bwd_h", "tp_re_x", "tp_re_h")


def _shape_comm(
    plan: ParallelPlan,
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    params: ModelParams,
    lt: Any,
    moe_frac: float,
) -> dict[str, float]:
    """One micro-batch's TP collective, MoE dispatch + combine and CP exchange of a shape."""
    tokens_mb = plan.micro_batch_size * model.seq_length / plan.cp
    act_bytes = tokens_mb * model.hidden_size * 2.0

    def collective(kind: str, size: float, n: int, stride: int) -> float:
        return comm.collective_time_s(cluster, kind, size, n, stride, params)

    out = {"act_bytes": act_bytes, "ep_fwd": 0.0, "ep_disp": 0.0, "ep_count": 0.0}
    out.update(dict.fromkeys(TP_TERMS, 0.0))
    if plan.tp > 1:
        terms = tp_layer_s(model, cluster, plan, training, params, act_bytes, collective, moe_frac)
        out.update(zip(TP_TERMS, terms, strict=True))
    if moe_frac and (plan.ep > 1 or plan.etp > 1):
        parts = moe_comm_fwd_s(model, cluster, plan, training, params, collective, split=True)
        out["ep_disp"], out["ep_fwd"] = parts[0], parts[0] + parts[1]
        out["ep_count"] = count_exchange_s(model, cluster, plan, training, params)
    out.update(fwd_c=0.0, fwd_x=0.0, bwd_c=0.0, bwd_x=0.0)
    if plan.cp > 1:
        fwd_c, fwd_x, bwd_c, bwd_x = cp_exchange_s(model, cluster, plan, training, params, lt)
        out.update(fwd_c=fwd_c, fwd_x=fwd_x, bwd_c=bwd_c, bwd_x=bwd_x)
    return out


def tp_layer_s(
    model: ModelSpec,
    cluster: ClusterSpec,
    plan: ParallelPlan,
    training: TrainingSpec,
    params: ModelParams,
    act_bytes: float,
    collective: Any,
    moe_frac: float,
) -> tuple[float, float, float, float, float, float]:
    """One layer's tensor-parallel exchanges of a micro-batch, (forward exposed, forward
    hidden, backward exposed, backward hidden, exposed and hidden of the gathers op-level
    checkpointing repeats in the backward): all-reduces, or with sequence parallelism
    all-gathers and reduce-scatters of its activations, hidden behind the linears' GEMMs as
    ``training.tp_comm_overlap`` says (perf/step/tp_overlap.py)."""
    t, sp = plan.tp, plan.sequence_parallel
    gather = collective("all_gather", act_bytes, t, 1) if sp else 0.0
    reduce = collective("reduce_scatter" if sp else "all_reduce", act_bytes, t, 1)
    gpu, precision, cal = cluster.gpu, training.precision, cluster.calibration

    def gemm(m: float, n: float, k: float) -> float:
        return compute.gemm_time_s(m, n, k, gpu, precision, params, cal)

    mode, hide = training.tp_comm_overlap, params.overlap_efficiency
    whole = tp_overlap.tp_gemms(model, plan, gemm, moe_frac)
    gemms = (whole, whole, whole)
    if mode in ("userbuffers", "async_tp"):  # the chunked GEMMs only where a mode runs them
        split = (t, tp_overlap.UB_PIPELINE_SPLITS)
        gemms = (whole, *(tp_overlap.tp_gemms(model, plan, gemm, moe_frac, n) for n in split))
    terms = tp_overlap.layer_tp_comm_s(mode, sp, t, gather, reduce, gemms, hide)
    regather = (0.0, 0.0)
    if sp:  # what op-level checkpointing gathers again in the backward (recompute = "op")
        feeds = ()
        if mode == "async_tp":  # the only mode that reads them
            feeds = tp_overlap.op_recomputed_gemms(model, plan, gemm, moe_frac)
        regather = tp_overlap.op_regather_s(mode, gather, feeds, t, hide)
    return (*terms, *regather)


def cp_exchange_s(
    model: ModelSpec,
    cluster: ClusterSpec,
    plan: ParallelPlan,
    training: TrainingSpec,
    params: ModelParams,
    lt: Any,
) -> tuple[float, float, float, float]:
    """One layer's context-parallel K/V exchange of a micro-batch: (forward time, forward
    exposed, backward time, backward exposed), hidden behind the attention blocks.

    K/V of this rank's tokens: kv heads (all query heads when the trainer repeats them before
    the kernel), split over TP ranks, at least one per rank. Ring (Megatron-Core / TE p2p):
    (cp - 1) K/V transfers forward; backward cp messages carrying 2 (cp - 1) blocks, as
    Transformer Engine's ``AttnFuncWithCPAndKVP2P.backward`` sends them (context_parallel.py,
    TE d0067d0; aihpc's comm/ring.py the same): K/V alone, then cp - 2 of K/V with the previous
    block's dK/dV (in the K/V dtype) in one message, then the last dK/dV alone, which lands on
    its owner (the backward starts from the forward's last block and turns the ring round, so
    no hop brings it home). PyTorch's
    context_parallel (allgather): one all-gather of every rank's K/V per attention call
    (forward and backward), hidden only behind the first of the cp blocks; backward passes the
    fp32 dK/dV on after every block, the last transfer waited for at the end. A CTA cap slows
    the point-to-point transfers, not the all-gather (a ring collective)."""
    cp, t = plan.cp, plan.tp
    tokens_mb = plan.micro_batch_size * model.seq_length / cp
    heads = model.num_attention_heads if training.kv_repeat else model.kv_heads
    kv_local = 2 * tokens_mb * max(1.0, heads / t) * model.kv_channels * 2.0
    cross = plan.tp * cp > cluster.nvlink_domain
    hide, ctas = params.overlap_efficiency, training.cp_comm_ctas
    if training.cp_exchange == "allgather":
        ag = comm.collective_time_s(cluster, "all_gather", cp * kv_local, cp, t, params)
        dkv = comm.p2p_time_s(cluster, 2 * kv_local, cross, params, channels=ctas)
        blk_f, blk_b = lt.fwd_attn / cp, lt.bwd_attn / cp
        fwd_x = max(0.0, ag - hide * blk_f)
        bwd_x = max(0.0, ag - hide * blk_b) + (cp - 1) * max(0.0, dkv - hide * blk_b)
        bwd_x += dkv
        return ag, fwd_x, ag + cp * dkv, bwd_x
    step = comm.p2p_time_s(cluster, kv_local, cross, params, channels=ctas)
    fwd_c = (cp - 1) * step
    both = comm.p2p_time_s(cluster, 2 * kv_local, cross, params, channels=ctas)
    bwd_c = 2 * step + (cp - 2) * both if cp > 1 else 0.0
    return fwd_c, max(0.0, fwd_c - hide * lt.fwd_attn), bwd_c, max(0.0, bwd_c - hide * lt.bwd_attn)


def count_exchange_s(
    model: ModelSpec,
    cluster: ClusterSpec,
    plan: ParallelPlan,
    training: TrainingSpec,
    params: ModelParams,
) -> float:
    """aihpc's own dispatcher (the trainer, where the host is the device; no framework stack
    named): before each dispatch stage's data, one all-to-all of a (peers, 1 + local experts)
    int64 count table that the host reads (comm/route.py, ``plan_route``), one stage per level;
    the backward reuses the counts. 0 elsewhere (a GPU framework's count exchange is priced
    with its dispatcher's host work, perf/step/moe_host.py)."""
    stack = stack_of(training)
    if not cluster.gpu.host_is_device or stack is not None or plan.ep <= 1:
        return 0.0
    table = plan.ep * (1 + model.num_experts / plan.ep) * 8.0
    one = comm.moe_all_to_all_time_s(cluster, table, table, plan.ep, plan.etp, False, 0.0, params)
    return (2 if training.moe_dispatcher == "hierarchical" else 1) * one


def moe_comm_fwd_s(
    model: ModelSpec,
    cluster: ClusterSpec,
    plan: ParallelPlan,
    training: TrainingSpec,
    params: ModelParams,
    collective: Any,
    split: bool = False,
) -> Any:
    """Forward dispatch + combine of one MoE layer for one micro-batch on one GPU, seconds
    (``split``: the pair (dispatch, combine), the expert-TP all-gather with the dispatch and
    its reduce-scatter with the combine).

    The layer's input is split over tp x cp (sequence parallel): each rank routes its own
    tokens. Dispatch moves each token's top-k copies in ``moe_dispatch_dtype``, combine brings
    them back in 16 bits, over the EP group: ep ranks etp apart (Megatron-Core's expert rank
    order puts etp innermost). With etp > 1 the received copies are all-gathered over the etp
    ranks before the experts and reduce-scattered after them."""
    tokens = plan.micro_batch_size * model.seq_length / (plan.cp * plan.tp)
    h, k = model.hidden_size, model.moe_top_k
    load = training.moe_imbalance  # the busiest rank receives this much more
    if model.moe_capacity_factor is not None:
        load = min(load, model.moe_capacity_factor)
    stack = stack_of(training)
    reach = stack.nvlink_reach if stack is not None else 0
    if stack is not None and stack.capacity_padding:  # every expert receives its capacity
        load = model.moe_capacity_factor or 1.0
    _, domains = comm.group_tiers(cluster, plan.ep, plan.etp, reach)
    remote = comm.remote_domains_per_token(
        domains, k, model.moe_router_groups, model.moe_router_group_topk
    )
    hier = (stack.dispatcher if stack else training.moe_dispatcher) == "hierarchical"
    limit = (model.moe_router_groups, model.moe_router_group_topk)
    parts = [0.0, 0.0]
    fp8 = training.moe_dispatch_dtype == "fp8"
    for i, (nbytes, column) in enumerate(
        (
            (1.0 if fp8 else 2.0, "dispatch_fp8" if fp8 else "dispatch_bf16"),
            (2.0, "combine"),
        )
    ):
        one = tokens * h * nbytes
        if stack is not None and stack.dispatcher == "allgather":  # gather in, scatter out
            what = "all_gather" if column != "combine" else "reduce_scatter"
            parts[i] += collective(what, one * plan.ep, plan.ep, plan.etp)
            continue
        t = None
        if stack is not None and stack.kernel != "nccl":
            t = comm.moe_kernel_a2a_time_s(
                cluster,
                stack.kernel,
                stack.sms,
                column,
                one,
                k,
                plan.ep,
                plan.etp,
                reach,
                limit,
                params,
            )
        if t is None:
            t = comm.moe_all_to_all_time_s(
                cluster, one * k, one, plan.ep, plan.etp, hier, remote, params, reach
            )
        parts[i] += load * t
    if plan.etp > 1:
        recv = tokens * k * h * 2.0 * load
        parts[0] += collective("all_gather", recv * plan.etp, plan.etp, 1)
        parts[1] += collective("reduce_scatter", recv * plan.etp, plan.etp, 1)
    return (parts[0], parts[1]) if split else parts[0] + parts[1]
