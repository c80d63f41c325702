"""The figures of a plan that depend only on its (tp, cp, micro-batch, SP, ep, etp) shape --
kernel times, the tensor-parallel collective, the MoE dispatch, the context-parallel exchange,
the saved activations -- computed once per distinct shape by the scalar functions
``estimate_plan`` calls, and gathered into arrays over the plans.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from aihpc.perf import comm, compute
from aihpc.perf.estimate import _moe_comm_fwd
from aihpc.perf.memory import activation_bytes_per_layer
from aihpc.perf.params import ModelParams
from aihpc.perf.plan_batch import PlanBatch, group
from aihpc.spec.cluster import ClusterSpec
from aihpc.spec.model import ModelSpec
from aihpc.spec.parallel import RECOMPUTE, ParallelPlan
from aihpc.spec.training import TrainingSpec

__all__ = ["Shapes"]


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
