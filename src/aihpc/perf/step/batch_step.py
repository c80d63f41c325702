"""A step is a sum of named terms: compute and recompute, tensor-, expert- and context-parallel
communication (exposed and hidden), activation offload, the pipeline bubble and its
point-to-point transfers, data-parallel and expert-data-parallel communication, the compute the
hidden communication slows down, the optimizer. ``StepTerms`` holds one method per term, in that
order; each takes one plan (``PlanBatch.of``: plain Python numbers, ``estimate_plan``) or numpy
arrays of plans (the search) -- the same arithmetic, so both give the same floats.
docs/performance-model.md walks the terms in this order.
"""

from __future__ import annotations

from typing import Any

from aihpc.perf.step import dp_comm, page_faults
from aihpc.perf.step.compute import optimizer_time_s
from aihpc.perf.step.dtensor_host import optimizer_host_s
from aihpc.perf.step.eager_host import eager_outside, optimizer_eager_host_s
from aihpc.perf.step.memory import warmup_chunks
from aihpc.perf.step.moe_overlap import paired_exposed_s
from aihpc.perf.step.numeric import any_, maximum, minimum, where
from aihpc.perf.step.params_norm import params_norm_s
from aihpc.perf.step.pipeline import (
    bubble_slots,
    dualpipe_bubble_slots,
    p2p_transfers,
    zero_bubble_fraction,
)
from aihpc.perf.step.plan_batch import (
    A2A_1F1B,
    A2A_DUALPIPE,
    A2A_NONE,
    OP,
)
from aihpc.perf.step.step_state import StepState
from aihpc.runspec.errors import SpecError

__all__ = ["TIME_KEYS", "StepTerms"]

# The step's terms as ``Estimate.time_s`` names them (aihpc estimate --json "time_s").
TIME_KEYS = (
    "compute",
    "recompute",
    "tp_comm",
    "cp_comm",
    "ep_comm",
    "pp_comm",
    "dp_comm",
    "pipeline_bubble",
    "optimizer",
    "offload",
)


class StepTerms(StepState):
    """The step-time terms of one plan or of arrays of plans: one method per term, over the
    figures of ``StepState``. Per micro-batch on the slowest pipeline stage (``*_mb``) unless a
    name says per step."""

    def terms(self) -> tuple[dict[str, Any], Any]:
        """(the step's terms by TIME_KEYS, the step time), each per step."""
        self.balanced_split()
        m = self.m
        compute_mb, recompute_mb = self.compute(), self.recompute()
        tp_mb, hidden_tp = self.tp_comm()
        ep_mb, hidden_ep = self.ep_comm()
        cp_mb, hidden_cp = self.cp_comm()
        hidden_mb = hidden_tp + hidden_ep + hidden_cp
        offload_mb = self.offload()
        t_mb = compute_mb + recompute_mb + tp_mb + cp_mb + ep_mb
        bubble = self.bubble(t_mb)
        pp_time = self.pp_comm()
        dp_time, hidden = self.dp_comm(compute_mb, recompute_mb)
        dp_time, hidden = self.expert_dp_comm(dp_time, hidden)
        penalty = self.overlap_penalty(hidden, hidden_mb)
        opt = self.optimizer()
        compute_total = m * compute_mb + penalty
        step = compute_total + m * (recompute_mb + tp_mb + cp_mb + ep_mb + offload_mb)
        step = step + (bubble + pp_time + dp_time + opt)
        values = (compute_total, m * recompute_mb, m * tp_mb, m * cp_mb, m * ep_mb, pp_time)
        values += (dp_time, bubble, opt, m * offload_mb)
        # what each kind of communication hid behind compute, per step (not in the step time)
        self.hidden_s = {
            "tp_comm": m * hidden_tp,
            "cp_comm": m * hidden_cp,
            "ep_comm": m * hidden_ep,
            "dp_comm": hidden,
        }
        return dict(zip(TIME_KEYS, values, strict=True)), step

    def step_time(self) -> Any:
        return self.terms()[1]

    def balanced_split(self) -> None:
        """training.pipeline_split = balanced: the embedding and the loss each take one layer's
        slot of the split (Megatron-Core's --account-for-embedding/loss-in-pipeline-split, and
        the custom layouts of Megatron-Bridge's DeepSeek-V3 and Kimi-K2 recipes,
        "Et|(tt|)*30mL"): the last stage holds one layer fewer beside the output head(s). The
        busier of a middle stage and the last one is priced."""
        b, model = self.b, self.model
        if self.training.pipeline_split != "balanced":
            return
        multi = b.pp > 1
        per = -(-(model.num_layers + model.mtp_layers + 2) // (b.pp * b.vpp)) * b.vpp
        one = self.fwd_layer + self.bwd_layer + self.recompute_layer
        whole = per * one >= (per - 1) * one + self.lfwd + self.lbwd
        self.layers = where(multi, where(whole, per, per - 1), self.layers)
        self.lfwd = where(multi & whole, 0.0, self.lfwd)
        self.lbwd = where(multi & whole, 0.0, self.lbwd)

    def compute(self) -> Any:
        """The stage's layers forward and backward, and the output layer with the loss (the
        last stage, the slowest: it also runs the output layer)."""
        return self.layers * (self.fwd_layer + self.bwd_layer) + self.lfwd + self.lbwd

    def recompute(self) -> Any:
        """The forward work the recompute policy runs again in the backward."""
        return self.layers * self.recompute_layer

    def tp_comm(self) -> tuple[Any, Any]:
        """(exposed, hidden) tensor-parallel collectives: 2 all-reduces forward, 2 backward per
        layer (all-gather + reduce-scatter pairs with SP), hidden behind the linears' GEMMs as
        the framework overlaps them (perf/step/tp_overlap.py); full recompute repeats the forward's,
        op-level recompute its all-gathers (tp_overlap.op_regather_s)."""
        sh, reps, op = self.sh, where(self.full, 2, 1), where(self.b.rec == OP, 1, 0)
        on = self.b.tp > 1
        exposed = self.layers * (reps * sh["tp_fwd_x"] + sh["tp_bwd_x"] + op * sh["tp_re_x"])
        hidden = self.layers * (reps * sh["tp_fwd_h"] + sh["tp_bwd_h"] + op * sh["tp_re_h"])
        return where(on, exposed, 0.0), where(on, hidden, 0.0)

    def ep_comm(self) -> tuple[Any, Any]:
        """(exposed, hidden) expert-parallel dispatch and combine all-to-all per MoE layer. The
        backward moves the same bytes (the combine's gradient goes out as a dispatch, the
        dispatch's comes back as a combine); full recompute dispatches again. Overlapped with
        the other micro-batch's compute (Megatron-Core's 1F1B A2A overlap pairs one
        micro-batch's forward with another's backward; DualPipe does the same in every pair of
        its chunks); under 1F1B the warm-up forwards and the cool-down backwards have no
        partner: that share stays exposed."""
        b = self.b
        if not self.moe_frac:
            return b.zeros(), b.zeros()
        on = (b.ep > 1) | (b.etp > 1)
        reps = where(self.full, 2, 1)
        sh, moe_layers = self.sh, self.layers * self.moe_frac
        ep_all = moe_layers * (reps + 1) * sh["ep_fwd"]
        p, v, m = b.pp, b.vpp, self.m
        warm = where(p > 1, warmup_chunks(p, v, m), 1)
        paired = where(b.a2a == A2A_1F1B, maximum(0.0, 1 - warm / (m * v)), 1.0)
        # A paired layer's transfers hide behind the one sub-module each is paired with
        # (perf/step/moe_overlap.py); full recompute's second dispatch has no partner.
        disp, comb = sh["ep_disp"], sh["ep_fwd"] - sh["ep_disp"]
        eff = self.params.overlap_efficiency
        left = paired_exposed_s(
            disp, comb, sh["moe_af"], sh["moe_ab"], sh["moe_mf"], sh["moe_mb"], eff
        )
        exposed_paired = moe_layers * (left + (reps - 1) * sh["ep_fwd"])
        hidden_ep = paired * maximum(0.0, ep_all - exposed_paired)
        # DualPipe rearranges a chunk pair's parts and splits the SMs so that the all-to-alls
        # are "fully hidden" (DeepSeek-V3 report sec. 3.2.1): up to the whole layer's compute.
        window = eff * moe_layers * sh["moe_fb"]
        hidden_ep = where(b.a2a == A2A_DUALPIPE, minimum(ep_all, window), hidden_ep)
        none = b.a2a == A2A_NONE
        # the count exchange the host waits on (batch_shapes.count_exchange_s): never hidden
        ep_mb = where(none, ep_all, ep_all - hidden_ep) + moe_layers * reps * sh["ep_count"]
        return where(on, ep_mb, 0.0), where(on & (b.a2a != A2A_NONE), hidden_ep, 0.0)

    def cp_comm(self) -> tuple[Any, Any]:
        """(exposed, hidden) context-parallel K/V exchange (batch_shapes._shape_comm prices one
        layer's); full recompute runs the forward's again."""
        sh, layers = self.sh, self.layers
        fwd_reps = where(self.full, 2, 1)
        fwd_c, fwd_x, bwd_c, bwd_x = sh["fwd_c"], sh["fwd_x"], sh["bwd_c"], sh["bwd_x"]
        on = self.b.cp > 1
        cp_mb = where(on, layers * (fwd_reps * fwd_x + bwd_x), 0.0)
        hidden = where(on, layers * (fwd_reps * (fwd_c - fwd_x) + bwd_c - bwd_x), 0.0)
        return cp_mb, hidden

    def offload(self) -> Any:
        """Activation offloading: the first k layers' saved tensors go to host memory as each
        layer's forward ends and come back one layer ahead of its backward, on a copy stream; a
        copy longer than the layer it runs beside stalls the next layer by the difference."""
        b = self.b
        if not any_(b.offload):
            return b.zeros()
        link = self.cluster.gpu.host_link_GBps
        if link is None:  # plan_problem refuses this; check=False callers get the same answer
            raise SpecError("cluster.gpu_spec.host_link_GBps", None, "required to offload")
        copy = self.sh.by_rec(self.sh.act, b.rec) / (link * 1e9)
        fwd_w = maximum(0.0, copy - self.fwd_layer)
        bwd_w = maximum(0.0, copy - (self.bwd_layer + self.recompute_layer))
        return where(b.offload > 0, b.offload * (fwd_w + bwd_w), 0.0)

    def bubble(self, t_mb: Any) -> Any:
        """The pipeline bubble (pipeline.py), per step. ZB-V: the weight-gradient pass is half
        the layers' backward GEMMs (each dX has a dW of the same FLOPs); attention's backward,
        the recompute and the loss's backward belong to the input-gradient pass."""
        b, layers = self.b, self.layers
        w_mb = layers * self.sh["bwd_gemm"] / 2
        zb = 0.0
        if b.pp_schedule == "zbv":
            b_mb = layers * (self.bwd_layer + self.recompute_layer) + self.lbwd - w_mb
            zb = zero_bubble_fraction(layers * self.fwd_layer + self.lfwd, b_mb, w_mb)
        schedule = "zbv" if b.pp_schedule == "zbv" else "1f1b"
        bubble = bubble_slots(b.pp, b.vpp, schedule, zb) * t_mb
        dual = b.a2a == A2A_DUALPIPE
        if any_(dual):
            f_mb = layers * self.fwd_layer + self.lfwd
            dual_slots = dualpipe_bubble_slots(b.pp, f_mb, t_mb - f_mb, w_mb)
            bubble = where(dual, dual_slots * t_mb, bubble)
        return bubble

    def pp_comm(self) -> Any:
        """Point-to-point activations and gradients between stages, per step: one message of a
        micro-batch's activations (split over TP with SP) per transfer."""
        b = self.b
        multi = b.pp > 1
        if not any_(multi):
            return b.zeros()
        cross = b.tp * b.cp * b.dp >= self.cluster.nvlink_domain  # pp ranks tp*cp*dp apart
        hop = self.sh.pp_hop(cross)
        return where(multi, p2p_transfers(b.pp, b.vpp, self.m) * hop, 0.0)

    def dp_comm(self, compute_mb: Any, recompute_mb: Any) -> tuple[Any, Any]:
        """(exposed, hidden) data-parallel gradient reduction and ZeRO gathers, per step."""
        return dp_comm.dp_comm(self, compute_mb, recompute_mb)

    def expert_dp_comm(self, dp_time: Any, hidden: Any) -> tuple[Any, Any]:
        """dp_comm's (exposed, hidden) with the routed experts' reduction added."""
        return dp_comm.expert_dp_comm(self, dp_time, hidden)

    def overlap_penalty(self, hidden: Any, hidden_mb: Any) -> Any:
        """Compute slowed down by the communication hidden behind it (the step's and each
        micro-batch's), counted in the compute term: the calibration's measured fraction of
        the hidden time where it has one (a CPU host), else the model's."""
        hidden_all = hidden + self.m * hidden_mb
        cal = self.cluster.calibration
        measured = cal.overlap_compute_penalty if cal is not None else None
        penalty = self.params.overlap_compute_penalty if measured is None else measured
        return penalty * maximum(0.0, hidden_all)

    def optimizer(self) -> Any:
        """The optimizer step over the stage's parameters (the ZeRO shard of them)."""
        b = self.b
        shard = where(b.zero >= 1, self.shard_n, 1)
        gpu, params, training = self.cluster.gpu, self.params, self.training
        opt = optimizer_time_s(self.params_stage, b.zero, shard, gpu, params, training)
        # the routed experts' weights on this rank are updated too (their own ZeRO shard: over
        # the expert-data-parallel ranks, tp x cp x dp / (etp x ep)); a zero array for dense
        edp = maximum(1, b.tp * b.cp * b.dp // (b.etp * b.ep))
        opt = opt + optimizer_time_s(
            self.expert_params, b.zero, where(b.zero >= 1, edp, 1), gpu, params, training, 0
        )
        # --log-params-norm: the norm reads every trained parameter's fp32 main copy (its ZeRO
        # shard under the distributed optimizer; perf/step/params_norm.py)
        opt = opt + params_norm_s(self.params_stage, 0.0, shard, 0, gpu, training, params)
        tied, cal = self.model.tied_embeddings, self.cluster.calibration
        # an eager optimizer's per-tensor loop on a CPU host (perf/step/eager_host.py)
        opt = opt + optimizer_eager_host_s(self.layers, b.pp, tied, gpu, training, params)
        if eager_outside(training) and page_faults.priced(gpu):  # AdamW's fresh temporaries
            fresh = page_faults.optimizer_bytes(self.model, self.layers, b.tp, shard)
            opt = opt + page_faults.fault_time_s(fresh, gpu)
        if training.dtensor_dispatch != "eager":
            return opt
        return opt + optimizer_host_s(opt, b, self.layers, tied, gpu, params, cal)
