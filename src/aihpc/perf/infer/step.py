"""One engine step on one GPU: compute by kernel class (kernels.py) plus the step's
communication (comm.py), through a pipeline of ``pp`` stages.

A step of a pipeline-parallel engine runs ``pp`` micro-batches, one per stage at a time (vLLM's
virtual engines, TensorRT-LLM's in-flight batching over stages): each micro-batch's token
passes every stage once, so a decode step's cycle is pp stage times of batch / pp sequences and
pp hops, and each sequence advances one token per cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from aihpc.perf.infer.comm import deepep_ll_s, moe_normal_s, pp_hop_s, tp_all_reduce_s
from aihpc.perf.infer.kernels import (
    Engine,
    StageCompute,
    Work,
    busiest_expert_share,
    host_issue_s,
    stage_compute,
)
from aihpc.perf.infer.kv import stage_layer_counts
from aihpc.perf.infer.software import gpu_sms
from aihpc.runspec.cluster import ClusterSpec

__all__ = ["StepTime", "step_time"]


@dataclass(frozen=True)
class StepTime:
    """One step of one data-parallel rank's batch, seconds, by term (every stage's work and
    hops included)."""

    compute: StageCompute
    tp_comm: float
    ep_comm: float
    pp_comm: float
    stages: int = 1  # stage times in the step (pp for a pipeline cycle)
    # two-batch overlap: the share of the SMs the overlapped all-to-all holds (None:
    # communication is added to the step)
    overlap_sm_share: float | None = None
    # one stage's kernels issued from Python without CUDA graphs (kernels.host_issue_s; 0: not
    # host-issued): a stage takes no less than it
    host_issue: float = 0.0

    @property
    def stage_s(self) -> float:
        """One stage's time. Added terms; or, under two-batch overlap, the longer of the
        communication C and the compute W on the SMs the communication leaves (a share s held
        for the whole overlapped forward): max(C, W / (1 - s)). The compute stream never has
        every SM: DeepSeek's prefill schedule gives computation 108 of the H800's 132 SMs and
        the all-to-all 24 for the whole layer (deepseek-ai/profile-data, assets/prefill.jpg:
        one micro-batch's combine or dispatch beside each compute block of the other), and
        SGLang's two-batch-overlap prefill runs its DeepGEMM kernels on ``total SMs - DeepEP's
        SMs`` for the whole overlapped forward (sglang batch_overlap/operations_strategy.py,
        ``_compute_moe_deepseek_blog_prefill``: ``deep_gemm_num_sms``). Without CUDA graphs
        in a Python-driven engine, no shorter than the host's issue of its kernels (the GPU
        idles between kernels it runs faster than they come)."""
        return max(self._gpu_stage_s, self.host_issue)

    @property
    def _gpu_stage_s(self) -> float:
        comm = self.tp_comm + self.ep_comm
        if self.overlap_sm_share is None:
            return self.compute.total + comm
        return max(comm, self.compute.total / (1.0 - self.overlap_sm_share))

    @property
    def total(self) -> float:
        return self.stages * self.stage_s + self.pp_comm

    def terms(self) -> dict[str, float]:
        """Seconds per term over the whole step."""
        c, n = self.compute, self.stages
        return {
            "gemm": n * c.gemm,
            "moe_experts": n * c.moe,
            "attention_prefill": n * c.attention_prefill,
            "attention_decode": n * c.attention_decode,
            "elementwise": n * c.elementwise,
            "logits": n * c.logits,
            "launches": n * c.launches,
            "tp_comm": n * self.tp_comm,
            "ep_comm": n * self.ep_comm,
            "pp_comm": self.pp_comm,
            "host_wait": n * max(self.host_issue - self._gpu_stage_s, 0.0),
        }

    def to_json(self) -> dict[str, Any]:
        out = {"total_s": self.total, **{f"{k}_s": v for k, v in self.terms().items()}}
        out["overlap_sm_share"] = self.overlap_sm_share
        return out


def _scaled(w: Work, share: float) -> Work:
    return replace(w, prefill_tokens=w.prefill_tokens * share, decode_seqs=w.decode_seqs * share)


def _overlap_share(e: Engine, w: Work) -> float | None:
    """The SM share of the overlapped communication where a prefill step of an expert-parallel
    plan runs two micro-batches (software.two_batch_overlap), else None."""
    sw, p = e.plan.software, e.plan
    if not (sw.two_batch_overlap and w.prefill_tokens > 0 and p.ep > 1 and p.dp > 1):
        return None
    sms = gpu_sms(e.gpu.id)
    return min(sw.comm_sms / sms, 1.0) if sms else 0.0


def _stage_comm(e: Engine, cluster: ClusterSpec, w: Work) -> tuple[float, float]:
    """(tp, ep) communication of one stage for one micro-batch ``w``: two all-reduces per layer
    over tp (after attention and after the FFN); an MoE layer whose experts spread over
    several data-parallel ranks dispatches and combines its tokens (DeepEP) in place of the
    second all-reduce; with one data-parallel rank the experts' partial sums join the
    all-reduce, as vLLM's and SGLang's TP-group expert parallelism does."""
    m, p = e.model, e.plan
    dense, moe = stage_layer_counts(m, p.pp)
    t = w.tokens
    ar = tp_all_reduce_s(cluster, t * m.hidden_size * e.act_bytes, p.tp, e.params)
    a2a = 0.0
    if moe and p.ep > 1 and p.dp > 1:
        per_rank = t / p.tp  # a tp group's ranks split its tokens for the dispatch
        if w.prefill_tokens <= 0:
            dispatch, combine = deepep_ll_s(
                cluster, per_rank, m.hidden_size, m.moe_top_k, p.ep, e.params
            )
        else:
            dispatch, combine = moe_normal_s(cluster, per_rank, m, p.ep, e.params)
        # the busiest GPU receives more than the mean copies and returns them
        busiest = busiest_expert_share(e, t)
        return dense * 2 * ar + moe * ar, moe * (dispatch + combine) * busiest
    return (dense + moe) * 2 * ar, a2a


def step_time(e: Engine, cluster: ClusterSpec, w: Work) -> StepTime:
    """One step of ``w`` (one data-parallel rank's work) on this engine."""
    pp = e.plan.pp
    if pp == 1:
        tp_c, ep_c = _stage_comm(e, cluster, w)
        host = host_issue_s(e, w)
        return StepTime(stage_compute(e, w), tp_c, ep_c, 0.0, 1, _overlap_share(e, w), host)
    micro = _scaled(w, 1.0 / pp)
    tp_c, ep_c = _stage_comm(e, cluster, micro)
    # the output layer runs on the last stage only: one stage in pp carries it
    compute = stage_compute(e, micro)
    compute = replace(compute, logits=compute.logits / pp)
    hop = pp_hop_s(cluster, micro.tokens * e.model.hidden_size * e.act_bytes, e.plan.tp, e.params)
    host = host_issue_s(e, micro)
    return StepTime(compute, tp_c, ep_c, pp * hop, pp, _overlap_share(e, micro), host)
