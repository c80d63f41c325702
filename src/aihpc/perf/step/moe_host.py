"""Host-bound time of an eager MoE layer (``training.cuda_graphs = "none"``), in seconds.

An eager Megatron-Core MoE layer is issued op by op from Python, and its forward stops the host
until the GPU has caught up where it needs the routed token counts on the host: the alltoall
dispatcher waits on the device-to-host copy of its split sizes before the expert-parallel
all-to-all (``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize``, ``d2h_event.
synchronize()`` at "before_ep_alltoall"); the flex dispatcher with HybridEP reads the received
token count inside ``dispatch_with_permute`` (``non_blocking = num_permuted_tokens is not None``,
``fused_a2a.py``) and ``TEGroupedMLP.forward`` then calls ``tokens_per_expert.tolist()`` on the
count the dispatch returned (``experts.py``): one sync a layer with alltoall, two with the flex
dispatcher (Megatron-LM 23265d2, April 2026, the commit Megatron-Bridge 5acef93 pinned when the
26.04 table was published). The backward needs no count (the splits are kept on the host).

Between two syncs the GPU cannot start kernels faster than the host issues them, so a segment
takes max(GPU time + the host's latency to issue the first op after the sync, host time to issue
all of its ops) (``host_bound_s``). A layer's forward is one such segment per layer (the second
HybridEP sync falls right after the dispatch, adding one more issue latency); the backward has no
sync and runs at max(GPU, host). The ops are counted from the source (``moe_host_ops``).
"""

from __future__ import annotations

from aihpc.perf.step.moe_issue import SPLIT_DISPATCH_OPS, sync_ordered_s
from aihpc.perf.step.params import ModelParams

__all__ = ["host_bound_s", "moe_host_excess_s", "moe_host_ops", "moe_host_syncs"]

# Python-issued ops (PyTorch ops, Transformer Engine / NCCL calls from Python) of one eager MoE
# layer's forward and micro-batch, counted in Megatron-LM 23265d2 with Megatron-Bridge's MoE
# performance settings (moe_router_fusion, moe_permute_fusion, force load balancing, aux loss):
# TE attention block (layer-norm + QKV, two fused RoPE calls, q/k/v views, fused attention,
# output projection, two bias-dropout-adds, pre-MLP norm) 30; TopKRouter (gating linear with its
# casts 3, RandomSTE 3, view, fused top-k, fused aux-loss scores, the counts, fused aux loss,
# tracker 3, MoEAuxLossAutoScaler 2) 17; TEGroupedMLP outside its per-expert loops (tolist,
# probs unsqueeze, two GroupedLinear calls of ~6, the weighted SwiGLU 2, bias 1) 17.
_ATTN_OPS, _ROUTER_OPS, _MLP_OPS = 30, 17, 17
_FIXED_OPS = _ATTN_OPS + _ROUTER_OPS + _MLP_OPS
# The dispatcher's own. alltoall: preprocess (counts, splits, the counts' all-gather, slices and
# sums) 19, the device-to-host copies on the side stream 12, fused permute 2, two all-to-alls 4,
# the event sync 1, fused chunk sort and unsort 4, combine all-to-all 2, fused unpermute and view 3.
# hierarchical (flex with HybridEP or DeepEP): views and the routing-map reshape 7, fused
# dispatch 2, combine 1, the post-processing getters 2.
_DISPATCH_OPS = {"alltoall": 47, "hierarchical": 12}
# FP8: TEGroupedMLP pads each expert's rows to the FP8 alignment and unpads (Fp8Padding) 6 ops,
# and GroupedLinear quantizes each local expert's weight from Python (``quantize_weight`` in a
# loop over experts, grouped_linear.py of Transformer Engine at the same date), fc1 and fc2.
_FP8_OPS, _FP8_OPS_PER_EXPERT = 6, 2
# Kernels Transformer Engine launches from C++ per local expert (no Python per launch): fc1 and
# fc2 GEMMs (``general_grouped_gemm``), with FP8 current scaling the input's amax and cast for
# each (``split_quantize``) and the second kernel of each weight quantization.
_LAUNCHES_PER_EXPERT = {"bf16": 2, "fp8": 2 + 4 + 2}


def moe_host_ops(dispatcher: str, precision: str, local_experts: float) -> tuple[float, float]:
    """(Python-issued ops, kernels launched from C++) of one eager MoE layer's forward and
    micro-batch; the backward issues the same Python ops and twice the launches (data and
    weight gradients per expert)."""
    fp8 = precision == "fp8"
    ops = _FIXED_OPS + _DISPATCH_OPS[dispatcher]
    if fp8:
        ops += _FP8_OPS + _FP8_OPS_PER_EXPERT * local_experts
    launches = _LAUNCHES_PER_EXPERT["fp8" if fp8 else "bf16"] * local_experts
    return ops, launches


def moe_host_syncs(dispatcher: str) -> int:
    """Host waits on the GPU per MoE layer forward: the alltoall dispatcher's split sizes; the
    flex dispatcher's received count and TEGroupedMLP's ``tokens_per_expert.tolist()``."""
    return 1 if dispatcher == "alltoall" else 2


def host_bound_s(gpu_s: float, host_s: float, syncs: int, issue_s: float) -> float:
    """Time of work the GPU runs in ``gpu_s`` and the host issues in ``host_s``, in one segment
    after each of ``syncs`` host syncs: the GPU idles ``issue_s`` after each sync until the host
    has issued the first op, and cannot finish before the host has issued the last."""
    return max(gpu_s + syncs * issue_s, host_s)


def moe_host_excess_s(
    gpu_fwd_s: float,
    gpu_bwd_s: float,
    dispatcher: str,
    precision: str,
    local_experts: float,
    params: ModelParams,
    gpu_moe_fwd_s: float | None = None,
    host_ratio: float = 1.0,
) -> tuple[float, float]:
    """(forward, backward) seconds an eager MoE layer takes beyond its GPU time, one
    micro-batch: ``host_bound_s`` on the counted ops at ``params.host_eager_op_s`` per
    Python-issued op and ``params.kernel_overhead_s`` per kernel launched from C++. With the
    forward's MoE block time ``gpu_moe_fwd_s`` the forward is issued in its order around the
    sync (perf/step/moe_issue.py): the MoE block's host time does not hide behind the
    attention side's kernels. ``host_ratio``: the GPU's host's time per eager call over the x86
    host those costs were measured on (runspec/host_cpu.py: 2.75 on a Grace host), applied to
    every host term (the ops, the launches, the issue after a sync)."""
    ops, launches = moe_host_ops(dispatcher, precision, local_experts)
    op_s, launch_s = params.host_eager_op_s * host_ratio, params.kernel_overhead_s * host_ratio
    host_fwd, host_bwd = ops * op_s + launches * launch_s, ops * op_s + 2 * launches * launch_s
    syncs = moe_host_syncs(dispatcher)
    fwd = host_bound_s(gpu_fwd_s, host_fwd, syncs, op_s) - gpu_fwd_s
    if gpu_moe_fwd_s is not None:
        before, _ = SPLIT_DISPATCH_OPS[dispatcher]
        host_attn = (_ATTN_OPS + _ROUTER_OPS + before) * op_s
        gpu_attn = gpu_fwd_s - gpu_moe_fwd_s
        seg = sync_ordered_s(gpu_attn, gpu_moe_fwd_s, host_attn, host_fwd - host_attn, syncs, op_s)
        fwd = seg - gpu_fwd_s
    bwd = host_bound_s(gpu_bwd_s, host_bwd, 0, op_s) - gpu_bwd_s
    return fwd, bwd
