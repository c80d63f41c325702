"""Price many plans at once: the step-time terms and the memory total of ``estimate_plan`` over
numpy arrays of plans (one element per plan), for the search.

The arithmetic is ``estimate_plan``'s, term by term and in the same order of operations, so each
plan's step time is the same float; what depends only on a few plan fields (the kernel times of a
(tp, cp, micro-batch, SP, ep, etp) shape, the tensor- and context-parallel exchanges, the MoE
dispatch, the saved activations) is computed once per distinct value by the scalar functions of
``compute``, ``comm`` and ``memory`` and gathered into the arrays. The data-parallel collectives,
whose sizes vary with every stage split, run as array formulas (``comm.collective_times_s``).
tests/perf/test_search_fast.py holds the two paths to equal results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from aihpc.perf import comm, compute
from aihpc.perf.estimate import _moe_comm_fwd
from aihpc.perf.flops import (
    embedding_params,
    expert_params_per_layer,
    param_tensors_per_layer,
    params_per_layer,
    persistent_tensors_per_layer,
)
from aihpc.perf.memory import (
    DTYPE_BYTES,
    MOMENTS,
    GiB,
    activation_bytes_per_layer,
    largest_param_tensor,
    lazy_grad_points,
)
from aihpc.perf.params import ModelParams
from aihpc.spec.cluster import ClusterSpec
from aihpc.spec.errors import SpecError
from aihpc.spec.model import ModelSpec
from aihpc.spec.parallel import MOE_A2A_OVERLAPS, RECOMPUTE, ParallelPlan
from aihpc.spec.training import TrainingSpec

__all__ = ["BatchTimes", "PlanBatch", "price_batch"]

FULL, SELECTIVE, OP = RECOMPUTE.index("full"), RECOMPUTE.index("selective"), RECOMPUTE.index("op")
A2A_NONE, A2A_1F1B = MOE_A2A_OVERLAPS.index("none"), MOE_A2A_OVERLAPS.index("1f1b")


@dataclass(frozen=True)
class PlanBatch:
    """Plans as columns: integer arrays of degrees, ``rec`` an index into RECOMPUTE, ``a2a`` into
    MOE_A2A_OVERLAPS; the fields every plan of a search shares are scalars."""

    tp: np.ndarray
    pp: np.ndarray
    vpp: np.ndarray
    cp: np.ndarray
    dp: np.ndarray
    ep: np.ndarray
    etp: np.ndarray
    sp: np.ndarray
    zero: np.ndarray
    rec: np.ndarray
    mbs: np.ndarray
    a2a: np.ndarray
    offload: np.ndarray
    global_batch_size: int
    pp_schedule: str | None = None
    dp_shard: int | None = None
    recompute_modules: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.tp)

    def take(self, idx: np.ndarray) -> PlanBatch:
        cols = {f: getattr(self, f)[idx] for f in _COLUMNS}
        return PlanBatch(
            **cols,
            global_batch_size=self.global_batch_size,
            pp_schedule=self.pp_schedule,
            dp_shard=self.dp_shard,
            recompute_modules=self.recompute_modules,
        )

    def with_offload(self, offload: np.ndarray) -> PlanBatch:
        cols = {f: getattr(self, f) for f in _COLUMNS if f != "offload"}
        return PlanBatch(
            **cols,
            offload=offload,
            global_batch_size=self.global_batch_size,
            pp_schedule=self.pp_schedule,
            dp_shard=self.dp_shard,
            recompute_modules=self.recompute_modules,
        )

    def plan(self, i: int) -> ParallelPlan:
        """The i-th plan as a ParallelPlan."""
        return ParallelPlan(
            tp=int(self.tp[i]),
            pp=int(self.pp[i]),
            vpp=int(self.vpp[i]),
            cp=int(self.cp[i]),
            dp=int(self.dp[i]),
            ep=int(self.ep[i]),
            etp=int(self.etp[i]),
            moe_a2a_overlap=MOE_A2A_OVERLAPS[int(self.a2a[i])],
            sequence_parallel=bool(self.sp[i]),
            zero_stage=int(self.zero[i]),
            recompute=RECOMPUTE[int(self.rec[i])],
            micro_batch_size=int(self.mbs[i]),
            global_batch_size=self.global_batch_size,
            offload_layers=int(self.offload[i]),
            pp_schedule=self.pp_schedule,
            dp_shard=self.dp_shard,
            recompute_modules=self.recompute_modules,
        )


_COLUMNS = ("tp", "pp", "vpp", "cp", "dp", "ep", "etp", "sp", "zero", "rec", "mbs", "a2a")
_COLUMNS = (*_COLUMNS, "offload")


@dataclass(frozen=True)
class BatchTimes:
    """What the search ranks and filters on, one element per plan."""

    step_time_s: np.ndarray
    tokens_per_s_per_gpu: np.ndarray
    memory_total: np.ndarray  # bytes on the most loaded GPU
    offloaded: np.ndarray  # bytes of activations in host memory
    fits: np.ndarray
    act_layer: np.ndarray  # activation bytes one layer keeps, per micro-batch


def group(*cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the index of one plan of each distinct row of ``cols``, each plan's row number). The
    columns hold non-negative integers (degrees, counts, booleans)."""
    key = np.zeros(len(cols[0]), dtype=np.int64)
    for col in cols:
        key = key * (int(col.max()) + 1 if len(col) else 1) + col
    uniq, inv = np.unique(key, return_inverse=True)
    one = np.empty(len(uniq), dtype=np.int64)
    one[inv] = np.arange(len(key))  # any member will do: the row's figures are the same
    return one, inv


class _Shapes:
    """Scalar figures of each distinct (tp, cp, micro-batch, SP, ep, etp) shape, as arrays over
    the plans. Computed by the same functions ``estimate_plan`` calls."""

    def __init__(
        self,
        b: PlanBatch,
        model: ModelSpec,
        cluster: ClusterSpec,
        training: TrainingSpec,
        params: ModelParams,
    ) -> None:
        first, inv = group(b.tp, b.cp, b.mbs, b.sp, b.ep, b.etp)
        self.first, self.inv = first, inv
        rows = [self._row(b.plan(int(i)), model, cluster, training, params) for i in first]
        self.cols = {k: np.array([r[k] for r in rows]) for k in rows[0] if k != "rec"}
        self.rec = np.array([r["rec"] for r in rows])  # shapes x RECOMPUTE
        self.act = np.array([r["act"] for r in rows])  # shapes x RECOMPUTE
        self.act_none = self.act[:, RECOMPUTE.index("none")]
        self.model, self.cluster, self.training, self.params = model, cluster, training, params
        self.batch = b

    def __getitem__(self, key: str) -> np.ndarray:
        return self.cols[key][self.inv]

    def by_rec(self, table: np.ndarray, rec: np.ndarray) -> np.ndarray:
        return table[self.inv, rec]

    @staticmethod
    def _row(
        plan: ParallelPlan,
        model: ModelSpec,
        cluster: ClusterSpec,
        training: TrainingSpec,
        params: ModelParams,
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
            "rec": recs,
            "act": [
                activation_bytes_per_layer(model, plan, training, recompute=r) for r in RECOMPUTE
            ],
        }
        row.update(_shape_comm(plan, model, cluster, training, params, lt, moe_frac))
        return row

    def pp_hop(self, cross: np.ndarray) -> np.ndarray:
        """One pipeline send of each plan's activations, over NVLink or the network."""
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
    t = plan.tp
    tokens_mb = plan.micro_batch_size * model.seq_length / plan.cp
    act_bytes = tokens_mb * model.hidden_size * 2.0

    def collective(kind: str, size: float, n: int, stride: int) -> float:
        return comm.collective_time_s(cluster, kind, size, n, stride, params)

    out = {"act_bytes": act_bytes, "tp_one": 0.0, "ep_fwd": 0.0}
    if t > 1:
        if plan.sequence_parallel:
            one = collective("all_gather", act_bytes, t, 1) + collective(
                "reduce_scatter", act_bytes, t, 1
            )
        else:
            one = collective("all_reduce", act_bytes, t, 1)
        out["tp_one"] = one
    if moe_frac and (plan.ep > 1 or plan.etp > 1):
        out["ep_fwd"] = _moe_comm_fwd(model, cluster, plan, training, params, collective)
    out.update(fwd_c=0.0, fwd_x=0.0, bwd_c=0.0, bwd_x=0.0)
    if plan.cp > 1:
        heads = model.num_attention_heads if training.kv_repeat else model.kv_heads
        kv_local = 2 * tokens_mb * max(1.0, heads / t) * model.kv_channels * 2.0
        cross = plan.tp * plan.cp > cluster.nvlink_domain
        hide = params.overlap_efficiency
        ctas = training.cp_comm_ctas
        if training.cp_exchange == "allgather":
            ag = collective("all_gather", plan.cp * kv_local, plan.cp, plan.tp)
            dkv = comm.p2p_time_s(cluster, 2 * kv_local, cross, params, channels=ctas)
            blk_f, blk_b = lt.fwd_attn / plan.cp, lt.bwd_attn / plan.cp
            fwd_x = max(0.0, ag - hide * blk_f)
            bwd_x = max(0.0, ag - hide * blk_b) + (plan.cp - 1) * max(0.0, dkv - hide * blk_b)
            bwd_x += dkv
            fwd_c, bwd_c = ag, ag + plan.cp * dkv
        else:
            step = comm.p2p_time_s(cluster, kv_local, cross, params, channels=ctas)
            fwd_c = (plan.cp - 1) * step
            fwd_x = max(0.0, fwd_c - hide * lt.fwd_attn)
            bwd_c = 2 * fwd_c
            bwd_x = max(0.0, bwd_c - hide * lt.bwd_attn)
        out.update(fwd_c=fwd_c, fwd_x=fwd_x, bwd_c=bwd_c, bwd_x=bwd_x)
    return out


def price_batch(
    model: ModelSpec,
    cluster: ClusterSpec,
    b: PlanBatch,
    training: TrainingSpec,
    params: ModelParams,
) -> BatchTimes:
    """Step time, throughput and memory of every plan in ``b`` (``estimate_plan``'s figures)."""
    if b.offload.any() and cluster.gpu.host_link_GBps is None:
        raise SpecError("cluster.gpu_spec.host_link_GBps", None, "required to offload")
    if not len(b):
        empty = np.zeros(0)
        return BatchTimes(empty, empty, empty, empty, np.zeros(0, dtype=bool), empty)
    shapes = _Shapes(b, model, cluster, training, params)
    st = _StepTerms(model, cluster, training, params, b, shapes)
    step = st.step_time()
    tokens_step = b.global_batch_size * model.seq_length
    total, offloaded, act_layer = _memory_total(model, training, params, b, shapes)
    fits = total <= cluster.gpu.hbm_gib * GiB
    if cluster.gpu.host_mem_gib is not None:
        fits &= offloaded <= cluster.gpu.host_mem_gib * GiB
    return BatchTimes(
        step_time_s=step,
        tokens_per_s_per_gpu=tokens_step / step / cluster.num_gpus,
        memory_total=total,
        offloaded=offloaded,
        fits=fits,
        act_layer=act_layer,
    )


def _warmup_chunks(p: np.ndarray, v: np.ndarray, m: np.ndarray) -> np.ndarray:
    """memory.warmup_chunks for rank 0, over arrays."""
    ahead = np.where(v == 1, p - 1, 2 * (p - 1) + (v - 1) * p)
    return np.minimum(ahead, m * v)


class _StepTerms:
    """The step-time terms of ``estimate_plan`` over arrays, in its order."""

    def __init__(
        self,
        model: ModelSpec,
        cluster: ClusterSpec,
        training: TrainingSpec,
        params: ModelParams,
        b: PlanBatch,
        shapes: _Shapes,
    ) -> None:
        self.model, self.cluster, self.training, self.params = model, cluster, training, params
        self.b, self.sh = b, shapes
        self.m = b.global_batch_size // (b.dp * b.mbs)
        self.layers = -(-(model.num_layers + model.mtp_layers) // (b.pp * b.vpp)) * b.vpp
        self.moe_frac = model.num_moe_layers / model.num_layers if model.is_moe else 0.0
        self.full = b.rec == FULL
        self.fwd_layer, self.bwd_layer = shapes["fwd"], shapes["bwd"]
        self.recompute_layer = shapes.by_rec(shapes.rec, b.rec)
        self.lfwd, self.lbwd = shapes["lfwd"], shapes["lbwd"]

    def collective(self, kind: str, size: Any, n: Any, stride: Any) -> np.ndarray:
        return comm.collective_times_s(self.cluster, kind, size, n, stride, self.params)

    def balanced_split(self) -> None:
        """training.pipeline_split = balanced: the embedding and the loss take a layer's slot."""
        b, model = self.b, self.model
        if self.training.pipeline_split != "balanced":
            return
        multi = b.pp > 1
        per = -(-(model.num_layers + model.mtp_layers + 2) // (b.pp * b.vpp)) * b.vpp
        one = self.fwd_layer + self.bwd_layer + self.recompute_layer
        whole = per * one >= (per - 1) * one + self.lfwd + self.lbwd
        self.layers = np.where(multi, np.where(whole, per, per - 1), self.layers)
        self.lfwd = np.where(multi & whole, 0.0, self.lfwd)
        self.lbwd = np.where(multi & whole, 0.0, self.lbwd)

    def step_time(self) -> np.ndarray:
        self.balanced_split()
        layers, m, b = self.layers, self.m, self.b
        compute_mb = layers * (self.fwd_layer + self.bwd_layer) + self.lfwd + self.lbwd
        recompute_mb = layers * self.recompute_layer
        tp_mb, hidden_mb = self.tp_comm()
        ep_mb, hidden_ep = self.ep_comm()
        hidden_mb = hidden_mb + hidden_ep
        cp_mb, hidden_cp = self.cp_comm()
        hidden_mb = hidden_mb + hidden_cp
        offload_mb = self.offload()
        t_mb = compute_mb + recompute_mb + tp_mb + cp_mb + ep_mb
        bubble = self.bubble(t_mb)
        pp_time = self.pp_comm()
        dp_time, hidden = self.dp_comm(compute_mb, recompute_mb)
        dp_time, hidden = self.expert_dp_comm(dp_time, hidden)
        penalty = self.params.overlap_compute_penalty * np.maximum(0.0, hidden + m * hidden_mb)
        opt = self.optimizer()
        compute_total = m * compute_mb + penalty
        step = compute_total + m * (recompute_mb + tp_mb + cp_mb + ep_mb + offload_mb)
        del b
        return step + (bubble + pp_time + dp_time + opt)

    def tp_comm(self) -> tuple[np.ndarray, np.ndarray]:
        per_layer = np.where(self.full, 6, 4) * self.sh["tp_one"]
        ovl = self.params.tp_overlap_fraction
        on = self.b.tp > 1
        exposed = np.where(on, self.layers * per_layer * (1 - ovl), 0.0)
        return exposed, np.where(on, self.layers * per_layer * ovl, 0.0)

    def ep_comm(self) -> tuple[np.ndarray, np.ndarray]:
        b, zeros = self.b, np.zeros(len(self.b))
        if not self.moe_frac:
            return zeros, zeros
        on = (b.ep > 1) | (b.etp > 1)
        reps = np.where(self.full, 2, 1)
        ep_all = self.layers * self.moe_frac * (reps + 1) * self.sh["ep_fwd"]
        p, v, m = b.pp, b.vpp, self.m
        warm = np.where(p > 1, _warmup_chunks(p, v, m), 1)
        paired = np.where(b.a2a == A2A_1F1B, np.maximum(0.0, 1 - warm / (m * v)), 1.0)
        window = self.params.overlap_efficiency * self.layers * self.moe_frac * self.sh["moe_fb"]
        hidden_ep = np.minimum(paired * ep_all, window)
        none = b.a2a == A2A_NONE
        ep_mb = np.where(none, ep_all, ep_all - hidden_ep)
        return np.where(on, ep_mb, 0.0), np.where(on & ~none, hidden_ep, 0.0)

    def cp_comm(self) -> tuple[np.ndarray, np.ndarray]:
        sh, layers = self.sh, self.layers
        fwd_reps = np.where(self.full, 2, 1)
        fwd_c, fwd_x, bwd_c, bwd_x = sh["fwd_c"], sh["fwd_x"], sh["bwd_c"], sh["bwd_x"]
        on = self.b.cp > 1
        cp_mb = np.where(on, layers * (fwd_reps * fwd_x + bwd_x), 0.0)
        hidden = np.where(on, layers * (fwd_reps * (fwd_c - fwd_x) + bwd_c - bwd_x), 0.0)
        return cp_mb, hidden

    def offload(self) -> np.ndarray:
        b = self.b
        if not b.offload.any():
            return np.zeros(len(b))
        link = self.cluster.gpu.host_link_GBps
        assert link is not None
        copy = self.sh.by_rec(self.sh.act, b.rec) / (link * 1e9)
        fwd_w = np.maximum(0.0, copy - self.fwd_layer)
        bwd_w = np.maximum(0.0, copy - (self.bwd_layer + self.recompute_layer))
        return np.where(b.offload > 0, b.offload * (fwd_w + bwd_w), 0.0)

    def bubble(self, t_mb: np.ndarray) -> np.ndarray:
        b, layers = self.b, self.layers
        p, v = b.pp, b.vpp
        w_mb = layers * self.sh["bwd_gemm"] / 2
        if b.pp_schedule == "zbv":
            b_mb = layers * (self.bwd_layer + self.recompute_layer) + self.lbwd - w_mb
            f_mb = layers * self.fwd_layer + self.lfwd
            total = f_mb + b_mb + w_mb
            zb = np.where(
                total <= 0, 0.0, np.maximum(0.0, f_mb + b_mb - 2 * w_mb) / np.where(total, total, 1)
            )
            slots = (p - 1) / 2 * zb
        else:
            slots = (p - 1) / v
        bubble = np.where(p <= 1, 0.0, slots) * t_mb
        dual = b.a2a == MOE_A2A_OVERLAPS.index("dualpipe")
        if dual.any():
            f_mb = layers * self.fwd_layer + self.lfwd
            bwd_s = t_mb - f_mb
            slot = f_mb + bwd_s
            ok = (p >= 2) & (slot > 0)
            safe = np.where(slot > 0, slot, 1.0)
            dp_slots = (p / 2 - 1) * np.maximum(0.0, f_mb + 2 * bwd_s - 3 * w_mb) / safe
            bubble = np.where(dual, np.where(ok, dp_slots, 0.0) * t_mb, bubble)
        return bubble

    def pp_comm(self) -> np.ndarray:
        b = self.b
        multi = b.pp > 1
        if not multi.any():
            return np.zeros(len(b))
        cross = b.tp * b.cp * b.dp >= self.cluster.nvlink_domain
        hop = self.sh.pp_hop(cross)
        transfers = 2.0 * (self.m + (b.pp - 1) * b.vpp)
        return np.where(multi, transfers * hop, 0.0)

    def optimizer(self) -> np.ndarray:
        b, gpu, params, training = self.b, self.cluster.gpu, self.params, self.training
        shard = np.where(b.zero >= 1, self.shard_n, 1)
        updated = self.params_stage / np.where(b.zero >= 1, shard, 1)
        o = DTYPE_BYTES[training.optimizer_dtype]
        g = DTYPE_BYTES[training.grad_reduce_dtype]
        per_param = (3 * o + g) + 3 * o + 2
        return (
            updated * per_param / (gpu.hbm_bw_GBps * 1e9 * params.hbm_efficiency)
            + 4 * params.kernel_overhead_s
        )

    def dp_comm(
        self, compute_mb: np.ndarray, recompute_mb: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        return _dp_comm(self, compute_mb, recompute_mb)

    def expert_dp_comm(
        self, dp_time: np.ndarray, hidden: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        return _expert_dp_comm(self, dp_time, hidden)


def _layer_params_split(
    model: ModelSpec, layers: np.ndarray, tp: np.ndarray, etp: np.ndarray, ep: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """memory.layer_params_split over arrays."""
    if not model.is_moe:
        return layers * params_per_layer(model) / tp, np.zeros(len(layers))
    moe_layers = np.round(layers * model.num_moe_layers / model.num_layers).astype(np.int64)
    dense_layers = layers - moe_layers
    dense = dense_layers * params_per_layer(model) / tp
    routed = expert_params_per_layer(model)
    dense_moe = dense + moe_layers * (params_per_layer(model, moe=True) - routed) / tp
    experts = moe_layers * routed / (etp * ep)
    has = moe_layers > 0
    return np.where(has, dense_moe, dense), np.where(has, experts, 0.0)


def _dp_setup(st: _StepTerms) -> None:
    """The stage's parameters and the data-parallel groups (estimate_plan's names)."""
    b, model, training = st.b, st.model, st.training
    st.dp_n = b.dp * b.cp
    st.stride = np.where(b.cp > 1, b.tp, b.tp * b.cp)
    st.embeddings = np.where((b.pp > 1) | model.tied_embeddings, 1, 2)
    st.layer_params, st.expert_params = _layer_params_split(model, st.layers, b.tp, b.etp, b.ep)
    emb = embedding_params(model)
    st.params_stage = st.layer_params + st.embeddings * emb / b.tp
    st.grad_bytes = DTYPE_BYTES[training.grad_reduce_dtype] * st.params_stage
    st.layer_weight_bytes = 1.0 if training.fp8_param_gather else 2.0
    st.param_bytes = st.layer_weight_bytes * st.layer_params + 2.0 * (
        st.params_stage - st.layer_params
    )
    shard_group = b.dp_shard or b.dp
    st.shard_n = np.where(b.zero > 0, shard_group * b.cp, st.dp_n)
    st.struct_one, st.struct = group(st.layers, b.tp, b.pp, b.vpp, b.cp, b.zero, b.ep, b.etp)


def subgroup(one: np.ndarray, inv: np.ndarray, i: np.ndarray, mask: np.ndarray) -> tuple:
    """``group`` restricted to the plans ``i`` (those of ``mask``), for groups that lie wholly
    inside ``mask``: (positions in ``i`` of one plan per group, each plan's group there)."""
    inside = mask[one]
    pos = np.cumsum(inside) - 1
    local = np.empty(len(mask), dtype=np.int64)
    local[i] = np.arange(len(i))
    return local[one[inside]], pos[inv[i]]


def _dp_comm(
    st: _StepTerms, compute_mb: np.ndarray, recompute_mb: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Data-parallel gradient reduction and ZeRO gathers, exposed and hidden."""
    _dp_setup(st)
    b, model, training, hide = st.b, st.model, st.training, st.params.overlap_efficiency
    dp_n, shard_n, stride, layers, m = st.dp_n, st.shard_n, st.stride, st.layers, st.m
    emb = embedding_params(model)
    dp_time, hidden = np.zeros(len(b)), np.zeros(len(b))

    def coll(kind: str, size: np.ndarray, idx: np.ndarray) -> np.ndarray:
        n = (dp_n if kind == "all_reduce" else shard_n)[idx]
        one = st.collective(kind, size, n, stride[idx])
        if kind == "reduce_scatter":
            sn, dn = shard_n[idx], dp_n[idx]
            hsdp = sn < dn
            if hsdp.any():
                extra = st.collective(
                    "all_reduce", size / sn, np.where(hsdp, dn // sn, 1), stride[idx] * sn
                )
                one = np.where(hsdp, one + extra, one)
        return one

    if training.grad_reduce_overlap:
        last_bwd = layers * (st.bwd_layer + st.recompute_layer)
    else:
        last_bwd = np.zeros(len(b))
    first_fwd = layers * st.fwd_layer
    edge = np.where(b.zero == 3, st.embeddings, 1) * emb / b.tp
    edge_frac = np.minimum(1.0, edge / st.params_stage)
    edge_param_bytes = 2.0 * np.minimum(edge, st.params_stage - st.layer_params)
    body_param_bytes = st.param_bytes - edge_param_bytes
    grad_bytes = st.grad_bytes
    on = dp_n > 1
    keeps = (b.zero == 3) & (b.pp > 1)
    per_tensor = training.zero3_gather == "per_tensor"
    cases = {
        "z0": on & (b.zero == 0),
        "z12": on & ((b.zero == 1) | (b.zero == 2)),
        "z3pp": on & keeps,
        "z3": on & (b.zero == 3) & ~keeps,
    }
    for name, mask in cases.items():
        i = np.nonzero(mask)[0]
        if not len(i):
            continue
        # The collectives' sizes and groups follow from the stage split and the degrees alone:
        # priced once per distinct split, then gathered to every plan that has it.
        rep, inv = subgroup(st.struct_one, st.struct, i, mask)

        def c(kind: str, size: np.ndarray, i: np.ndarray = i) -> np.ndarray:
            return coll(kind, size[rep], i[rep])[inv]  # noqa: B023

        gb, ef = grad_bytes[i], edge_frac[i]
        lb, ff = last_bwd[i], first_fwd[i]
        if name == "z0" and not training.grad_reduce_overlap:
            d, h = c("all_reduce", gb), np.zeros(len(i))
        elif name == "z0":
            tail = c("all_reduce", gb * ef)
            rest = c("all_reduce", gb * (1 - ef))
            exposed = np.maximum(0.0, rest - hide * lb)
            d, h = tail + exposed, rest - exposed
        elif name in ("z12", "z3pp"):
            tail = c("reduce_scatter", gb * ef)
            head = c("all_gather", edge_param_bytes[i])
            grads = c("reduce_scatter", gb * (1 - ef))
            gather = c("all_gather", body_param_bytes[i])
            if name == "z12":
                exp_g = np.maximum(0.0, grads - hide * lb)
                exp_a = np.maximum(0.0, gather - hide * ff)
                d = tail + head + exp_g + exp_a
                h = grads + gather - exp_g - exp_a
            else:
                exp = np.maximum(0.0, gather - hide * ff) + np.maximum(0.0, grads - hide * lb)
                d, h = head + tail + exp, gather + grads - exp
        elif per_tensor:
            d, h = _per_tensor_zero3(st, c, i, lb)
        else:
            body_p = body_param_bytes[i] / layers[i]
            body_g = gb * (1 - ef) / layers[i]
            ag, rs = c("all_gather", body_p), c("reduce_scatter", body_g)
            per_mb = layers[i] * (2 * ag + rs)
            edges = c("all_gather", edge_param_bytes[i]) + c("reduce_scatter", gb * ef)
            window = hide * (compute_mb[i] + recompute_mb[i])
            exposed = np.maximum(0.0, per_mb - window)
            d, h = m[i] * (exposed + edges), m[i] * (per_mb - exposed)
        dp_time[i], hidden[i] = d, h
    return dp_time, hidden


def _per_tensor_zero3(
    st: _StepTerms, coll: Any, i: np.ndarray, last_bwd: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """DeepSpeed 0.3's per-tensor ZeRO-3 (estimate_plan's comments give the sources)."""
    model, params, gpu = st.model, st.params, st.cluster.gpu
    layers, m, dp_n = st.layers[i], st.m[i], st.dp_n[i]
    param_bytes, grad_bytes = st.param_bytes[i], st.grad_bytes[i]
    hide = params.overlap_efficiency
    tensors = layers * param_tensors_per_layer(model)
    persistent = layers * persistent_tensors_per_layer(model)
    gathered = tensors - persistent + 2
    gathers = np.where(st.full[i], 3, 2)
    view, launch = params.host_op_overhead_s, params.kernel_overhead_s
    bw = gpu.hbm_bw_GBps * 1e9 * params.hbm_efficiency
    ag_part = dp_n * (view + launch)
    ag = gathered * (coll("all_gather", param_bytes / gathered) + ag_part)
    ag += 3 * param_bytes / bw + 0 * params.kernel_overhead_s
    rs_part = dp_n * (2 * view + launch)
    rs_copies = tensors * rs_part + (2 * grad_bytes / bw + 0 * params.kernel_overhead_s)
    rs = tensors * coll("reduce_scatter", grad_bytes / tensors)
    rs_exposed = np.maximum(0.0, rs - hide * last_bwd)
    small = 2.0 * persistent * 4 * model.hidden_size
    post_part = dp_n * (4 * view + launch)
    post_step = persistent * post_part + ag_part + coll("all_gather", small)
    return m * (gathers * ag + rs_copies + rs_exposed) + post_step, m * (rs - rs_exposed)


def _expert_dp_comm(
    st: _StepTerms, dp_time: np.ndarray, hidden: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Routed experts' gradients over the expert-data-parallel group, in the dense part's room."""
    b, training, hide = st.b, st.training, st.params.overlap_efficiency
    i = np.nonzero(st.expert_params != 0)[0]
    if not len(i):
        return dp_time, hidden
    tp, cp, dp, etp, ep = b.tp[i], b.cp[i], b.dp[i], b.etp[i], b.ep[i]
    edp, e_stride = np.maximum(1, tp * cp * dp // (etp * ep)), etp * ep
    expert_params = st.expert_params[i]
    e_grad = DTYPE_BYTES[training.grad_reduce_dtype] * expert_params
    zero, m = b.zero[i], st.m[i]
    # as in _dp_comm: once per distinct stage split
    rep, inv = subgroup(st.struct_one, st.struct, i, st.expert_params != 0)
    ar = st.collective("all_reduce", e_grad[rep], edp[rep], e_stride[rep])[inv]
    rs = st.collective("reduce_scatter", e_grad[rep], edp[rep], e_stride[rep])[inv]
    e_weights = st.layer_weight_bytes * expert_params[rep]
    rs = rs + st.collective("all_gather", e_weights, edp[rep], e_stride[rep])[inv]
    rs = np.where((zero == 3) & ~(b.pp[i] > 1), rs * m, rs)
    e_time = np.where(edp > 1, np.where(zero == 0, ar, rs), 0.0)
    layers = st.layers[i]
    layers_bwd = layers * (st.bwd_layer[i] + st.recompute_layer[i])
    if training.grad_reduce_overlap:
        room = hide * (layers_bwd + layers * st.fwd_layer[i])
    else:
        room = np.zeros(len(i))
    e_exposed = np.maximum(0.0, e_time - np.maximum(0.0, room - hidden[i]))
    dp_time, hidden = dp_time.copy(), hidden.copy()
    dp_time[i] += e_exposed
    hidden[i] += e_time - e_exposed
    return dp_time, hidden


def _state_bytes(
    params_local: np.ndarray,
    zero: np.ndarray,
    pp: np.ndarray,
    d: np.ndarray,
    training: TrainingSpec,
    layer_local: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """memory._state_bytes over arrays (``d``: the ranks sharing the states)."""
    g, o = DTYPE_BYTES[training.grad_reduce_dtype], DTYPE_BYTES[training.optimizer_dtype]
    moments = MOMENTS[training.optimizer]
    fp8_cache = 1.0 if training.precision == "fp8" else 0.0
    z3, keeps = zero == 3, (zero == 3) & (pp > 1)
    w3 = o * params_local / d + np.where(
        keeps, (2 + fp8_cache) * params_local, (2 + fp8_cache) * 2 * layer_local
    )
    g3 = g * params_local / d + np.where(keeps, g * params_local, g * layer_local)
    o3 = moments * o * params_local / d
    w = (2 + fp8_cache) * params_local
    gr = g * params_local / np.where(zero == 2, d, 1)
    op = (1 + moments) * o * params_local / np.where(zero >= 1, d, 1)
    return np.where(z3, w3, w), np.where(z3, g3, gr), np.where(z3, o3, op)


def _memory_total(
    model: ModelSpec,
    training: TrainingSpec,
    params: ModelParams,
    b: PlanBatch,
    sh: _Shapes,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(memory_breakdown(...).total, .offloaded, activation bytes per layer) over arrays."""
    return _Memory(model, training, params, b, sh).total()


class _Memory:
    """memory.memory_breakdown over arrays: the most loaded stage's total and what is offloaded."""

    def __init__(
        self,
        model: ModelSpec,
        training: TrainingSpec,
        params: ModelParams,
        b: PlanBatch,
        sh: _Shapes,
    ) -> None:
        self.model, self.training, self.params, self.b = model, training, params, b
        p, v = b.pp, b.vpp
        self.m = m = b.global_batch_size // (b.dp * b.mbs)
        self.lps = -(-model.num_layers // (p * v)) * v
        one_dense, one_exp = _layer_params_split(
            model, np.ones(len(b), np.int64), b.tp, b.etp, b.ep
        )
        self.layer_local = np.where(one_exp != 0, one_dense + one_exp, one_dense)
        if training.zero3_gather == "per_tensor":
            self.layer_local = largest_param_tensor(model) / b.tp
        self.emb_local = embedding_params(model) / b.tp
        tokens = b.mbs * model.seq_length / b.cp
        self.act_layer = act = sh.by_rec(sh.act, b.rec)
        none = sh.act_none[sh.inv]
        self.working = np.where((b.rec == FULL) | (b.rec == OP), np.maximum(0.0, none - act), 0.0)
        mb = np.minimum(p, m)
        self.zbv_acts = act * self.lps * mb + self.working
        in_flight = np.where(
            v > 1, np.minimum(m, (np.minimum(2 * (p - 1) + (v - 1) * p, m * v) + 1) / v), mb
        )
        last_in_flight = np.where(v > 1, np.minimum(m, (np.minimum((v - 1) * p, m * v) + 1) / v), 1)
        off = b.offload
        self.resident = np.where(
            off > 0, np.maximum(self.lps - off, np.minimum(self.lps, 2)), self.lps
        )
        self.offloaded = np.where(off > 0, off, 0)
        self.first_acts = act * self.resident * in_flight + self.working
        self.last_acts = act * self.lps * last_in_flight + self.working
        loss_bytes = 14 if training.cross_entropy == "eager" else 6
        self.logits = tokens * (loss_bytes * model.vocab_size / b.tp + 4 * model.hidden_size)
        self.embed_out = (
            tokens * model.hidden_size * 2 * np.where(p > 1, mb, 1) / np.where(b.sp, b.tp, 1)
        )
        self.lazy = (b.zero == 3) & (training.zero3_gather == "bucketed") & (b.pp_schedule != "zbv")
        self.lazy_idx = np.nonzero(self.lazy)[0]
        i = self.lazy_idx
        self.lazy_groups = group(p[i], v[i], m[i]) if len(i) else (i, i)

    def total(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        b, model = self.b, self.model
        single = b.pp == 1
        zbv = b.pp_schedule == "zbv"
        n = len(b)
        both = self.logits + self.embed_out
        only = self.stage(np.full(n, model.num_layers), True, True, self.first_acts, both, "only")
        if zbv:
            multi = self.stage(self.lps, True, True, self.zbv_acts, both, "first")
        else:
            first = self.stage(self.lps, True, False, self.first_acts, self.embed_out, "first")
            last = self.stage(self.lps, False, True, self.last_acts, self.logits, "last")
            multi = np.where(first >= last, first, last)
        total = np.where(single, only, multi)
        return total, self.act_layer * self.offloaded, self.act_layer

    def stage(
        self,
        layer_count: np.ndarray,
        embed: bool,
        output: bool,
        acts: np.ndarray,
        buffers: np.ndarray,
        name: str,
    ) -> np.ndarray:
        b, model, training, params = self.b, self.model, self.training, self.params
        params_local, expert_local = _layer_params_split(model, layer_count, b.tp, b.etp, b.ep)
        if embed:
            params_local = params_local + self.emb_local
        if output and (not model.tied_embeddings or not embed):
            params_local = params_local + self.emb_local
        d = (b.dp_shard or b.dp) * b.cp
        w, g, o = _state_bytes(params_local, b.zero, b.pp, d, training, self.layer_local)
        has_e = expert_local != 0
        if has_e.any():
            edp = np.maximum(1, b.tp * b.cp * b.dp // (b.etp * b.ep))
            we, ge, oe = _state_bytes(expert_local, b.zero, b.pp, edp, training, self.layer_local)
            w, g, o = (
                np.where(has_e, w + we, w),
                np.where(has_e, g + ge, g),
                np.where(has_e, o + oe, o),
            )
        w = np.where(b.a2a == MOE_A2A_OVERLAPS.index("dualpipe"), w * 2, w)
        if self.lazy.any():
            acts, buffers, g = self._lazy(layer_count, output, acts, buffers, g, name)
        live = w + g + o + acts + buffers
        other = params.runtime_overhead_gib * GiB + params.allocator_fragmentation * live
        return w + g + o + acts + buffers + other

    def _lazy(
        self,
        layer_count: np.ndarray,
        output: bool,
        acts: np.ndarray,
        buffers: np.ndarray,
        g: np.ndarray,
        name: str,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """FSDP2's gradients appear at their chunk's first backward: the schedule's peak."""
        b = self.b
        acts, buffers, g = acts.astype(float), buffers.astype(float), g.astype(float)
        idx = self.lazy_idx
        p, v, m = b.pp[idx], b.vpp[idx], self.m[idx]
        one, inv = self.lazy_groups
        rank = (p - 1) if name == "last" else np.zeros(len(idx), dtype=np.int64)
        groups = [lazy_grad_points(int(p[i]), int(v[i]), int(m[i]), int(rank[i])) for i in one]
        # (groups x points x 3), padded with points that never win
        width = max(len(pts) for pts in groups)
        table = np.zeros((len(groups), width, 3), dtype=np.int64)
        valid = np.zeros((len(groups), width), dtype=bool)
        trivial = np.zeros(len(groups), dtype=bool)
        for j, pts in enumerate(groups):
            table[j, : len(pts)], valid[j, : len(pts)] = pts, True
            # one point with every gradient and the logits live is the plain sum: nothing to do
            trivial[j] = len(pts) == 1 and pts[0][1:] == (int(v[one[j]]), 1)
        keep = ~trivial[inv]
        sel, inv = idx[keep], inv[keep]
        vj = b.vpp[sel]
        gs = g[sel]
        gbytes = DTYPE_BYTES[self.training.grad_reduce_dtype]
        lazy = np.where(b.pp[sel] > 1, gs, gs - gbytes * self.layer_local[sel])
        count = layer_count[sel] if name == "last" else self.resident[sel]
        chunk_acts = self.act_layer[sel] * count / vj
        chunk_grads = lazy / vj
        transient = buffers[sel] if output else np.zeros(len(sel))
        pts = table[inv]  # plans x points x 3
        scores = (
            pts[:, :, 0] * chunk_acts[:, None]
            + pts[:, :, 1] * chunk_grads[:, None]
            + pts[:, :, 2] * transient[:, None]
        )
        scores = np.where(valid[inv], scores, -np.inf)
        best = pts[np.arange(len(sel)), np.argmax(scores, axis=1)]
        held, made, tail = best[:, 0], best[:, 1], best[:, 2]
        acts[sel] = held * chunk_acts + self.working[sel]
        buffers[sel] = buffers[sel] - transient * (1 - tail)
        g[sel] = gs - (lazy - made * chunk_grads)
        return acts, buffers, g
