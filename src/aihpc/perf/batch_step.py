"""The step-time terms of ``estimate_plan`` over arrays of plans, in its order and with its order
of operations (so each plan's step time is the same float): compute and recompute, tensor-,
expert- and context-parallel communication (exposed and hidden), activation offload, the
pipeline bubble and its point-to-point transfers, data-parallel communication, the optimizer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from aihpc.perf import comm
from aihpc.perf.batch_shapes import Shapes
from aihpc.perf.flops import embedding_params, param_tensors_per_layer, persistent_tensors_per_layer
from aihpc.perf.memory import DTYPE_BYTES
from aihpc.perf.params import ModelParams
from aihpc.perf.plan_batch import (
    A2A_1F1B,
    A2A_DUALPIPE,
    A2A_NONE,
    FULL,
    PlanBatch,
    group,
    layer_params_split,
    subgroup,
)
from aihpc.spec.cluster import ClusterSpec
from aihpc.spec.model import ModelSpec
from aihpc.spec.training import TrainingSpec

__all__ = ["StepTerms"]


def _warmup_chunks(p: np.ndarray, v: np.ndarray, m: np.ndarray) -> np.ndarray:
    """memory.warmup_chunks for rank 0, over arrays."""
    ahead = np.where(v == 1, p - 1, 2 * (p - 1) + (v - 1) * p)
    return np.minimum(ahead, m * v)


class StepTerms:
    """The step-time terms of ``estimate_plan`` over arrays, in its order."""

    def __init__(
        self,
        model: ModelSpec,
        cluster: ClusterSpec,
        training: TrainingSpec,
        params: ModelParams,
        b: PlanBatch,
        shapes: Shapes,
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
        dual = b.a2a == A2A_DUALPIPE
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


def _dp_setup(st: StepTerms) -> None:
    """The stage's parameters and the data-parallel groups (estimate_plan's names)."""
    b, model, training = st.b, st.model, st.training
    st.dp_n = b.dp * b.cp
    st.stride = np.where(b.cp > 1, b.tp, b.tp * b.cp)
    st.embeddings = np.where((b.pp > 1) | model.tied_embeddings, 1, 2)
    st.layer_params, st.expert_params = layer_params_split(model, st.layers, b.tp, b.etp, b.ep)
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


def _dp_collective(st: StepTerms, kind: str, size: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """One data-parallel collective of the plans ``idx`` (estimate_plan's ``coll``): all-reduce
    over dp x cp, ZeRO's gathers and reduce-scatters over the shard group; under HSDP the
    reduce-scattered shard is then all-reduced across the replicas."""
    dp_n, shard_n, stride = st.dp_n[idx], st.shard_n[idx], st.stride[idx]
    one = st.collective(kind, size, dp_n if kind == "all_reduce" else shard_n, stride)
    if kind == "reduce_scatter":
        hsdp = shard_n < dp_n
        if hsdp.any():
            groups = np.where(hsdp, dp_n // shard_n, 1)
            extra = st.collective("all_reduce", size / shard_n, groups, stride * shard_n)
            one = np.where(hsdp, one + extra, one)
    return one


def _dp_sizes(st: StepTerms) -> None:
    """The edge bucket (embedding, and the untied output layer under FSDP) and the rest: what
    the gathers and reductions move (estimate_plan gives the sources)."""
    b, hide = st.b, st.params.overlap_efficiency
    if st.training.grad_reduce_overlap:  # what a gradient reduction can hide behind
        st.last_bwd = hide * (st.layers * (st.bwd_layer + st.recompute_layer))
    else:
        st.last_bwd = np.zeros(len(b))
    st.first_fwd = hide * (st.layers * st.fwd_layer)
    edge = np.where(b.zero == 3, st.embeddings, 1) * embedding_params(st.model) / b.tp
    st.edge_frac = np.minimum(1.0, edge / st.params_stage)
    st.edge_param_bytes = 2.0 * np.minimum(edge, st.params_stage - st.layer_params)
    st.body_param_bytes = st.param_bytes - st.edge_param_bytes


def _dp_comm(
    st: StepTerms, compute_mb: np.ndarray, recompute_mb: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Data-parallel gradient reduction and ZeRO gathers, exposed and hidden, by ZeRO stage."""
    _dp_setup(st)
    _dp_sizes(st)
    b = st.b
    dp_time, hidden = np.zeros(len(b)), np.zeros(len(b))
    on, keeps = st.dp_n > 1, (b.zero == 3) & (b.pp > 1)
    per_tensor = st.training.zero3_gather == "per_tensor"
    cases = (
        (on & (b.zero == 0), _dp_zero0),
        (on & ((b.zero == 1) | (b.zero == 2)), _dp_zero12),
        (on & keeps, _dp_zero3_pp),
        (on & (b.zero == 3) & ~keeps, _per_tensor_zero3 if per_tensor else _dp_zero3),
    )
    for mask, term in cases:
        i = np.nonzero(mask)[0]
        if not len(i):
            continue
        # The collectives' sizes and groups follow from the stage split and the degrees alone:
        # priced once per distinct split, then gathered to every plan that has it.
        rep, inv = subgroup(st.struct_one, st.struct, i, mask)

        def c(kind: str, size: np.ndarray, i: np.ndarray = i) -> np.ndarray:
            return _dp_collective(st, kind, size[rep], i[rep])[inv]  # noqa: B023

        window = st.params.overlap_efficiency * (compute_mb[i] + recompute_mb[i])
        dp_time[i], hidden[i] = term(st, c, i, window)
    return dp_time, hidden


Coll = Any  # (kind, sizes of the plans i) -> seconds


def _dp_zero0(st: StepTerms, c: Coll, i: np.ndarray, window: np.ndarray) -> tuple:
    """DDP: one all-reduce after the backward, or bucketed behind it but for the edge bucket."""
    gb, ef = st.grad_bytes[i], st.edge_frac[i]
    if not st.training.grad_reduce_overlap:
        return c("all_reduce", gb), np.zeros(len(i))
    tail = c("all_reduce", gb * ef)
    rest = c("all_reduce", gb * (1 - ef))
    exposed = np.maximum(0.0, rest - st.last_bwd[i])
    return tail + exposed, rest - exposed


def _dp_zero12(st: StepTerms, c: Coll, i: np.ndarray, window: np.ndarray) -> tuple:
    """Distributed optimizer: reduce-scatter the gradients, all-gather the updated weights."""
    gb, ef = st.grad_bytes[i], st.edge_frac[i]
    tail = c("reduce_scatter", gb * ef)
    head = c("all_gather", st.edge_param_bytes[i])
    grads = c("reduce_scatter", gb * (1 - ef))
    gather = c("all_gather", st.body_param_bytes[i])
    exp_g = np.maximum(0.0, grads - st.last_bwd[i])
    exp_a = np.maximum(0.0, gather - st.first_fwd[i])
    return tail + head + exp_g + exp_a, grads + gather - exp_g - exp_a


def _dp_zero3_pp(st: StepTerms, c: Coll, i: np.ndarray, window: np.ndarray) -> tuple:
    """FSDP2 under PP: one gather of the stage before its first forward, one reduce-scatter
    after its last backward, hidden like ZeRO-1/2's."""
    gb, ef = st.grad_bytes[i], st.edge_frac[i]
    head = c("all_gather", st.edge_param_bytes[i])
    tail = c("reduce_scatter", gb * ef)
    gather = c("all_gather", st.body_param_bytes[i])
    grads = c("reduce_scatter", gb * (1 - ef))
    exp = np.maximum(0.0, gather - st.first_fwd[i]) + np.maximum(0.0, grads - st.last_bwd[i])
    return head + tail + exp, gather + grads - exp


def _dp_zero3(st: StepTerms, c: Coll, i: np.ndarray, window: np.ndarray) -> tuple:
    """ZeRO-3 / FSDP: one gather per layer for forward and backward, one reduce-scatter, per
    micro-batch; the root unit (edge) gathered and reduced on the critical path each time."""
    gb, ef, layers, m = st.grad_bytes[i], st.edge_frac[i], st.layers[i], st.m[i]
    body_p = st.body_param_bytes[i] / layers
    body_g = gb * (1 - ef) / layers
    per_mb = layers * (2 * c("all_gather", body_p) + c("reduce_scatter", body_g))
    edges = c("all_gather", st.edge_param_bytes[i]) + c("reduce_scatter", gb * ef)
    exposed = np.maximum(0.0, per_mb - window)
    return m * (exposed + edges), m * (per_mb - exposed)


def _per_tensor_zero3(st: StepTerms, coll: Coll, i: np.ndarray, window: np.ndarray) -> tuple:
    """DeepSpeed 0.3's per-tensor ZeRO-3 (estimate_plan's comments give the sources)."""
    model, params, gpu = st.model, st.params, st.cluster.gpu
    layers, m, dp_n = st.layers[i], st.m[i], st.dp_n[i]
    param_bytes, grad_bytes = st.param_bytes[i], st.grad_bytes[i]
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
    rs_exposed = np.maximum(0.0, rs - st.last_bwd[i])
    small = 2.0 * persistent * 4 * model.hidden_size
    post_part = dp_n * (4 * view + launch)
    post_step = persistent * post_part + ag_part + coll("all_gather", small)
    return m * (gathers * ag + rs_copies + rs_exposed) + post_step, m * (rs - rs_exposed)


def _expert_dp_comm(
    st: StepTerms, dp_time: np.ndarray, hidden: np.ndarray
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
