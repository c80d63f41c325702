"""Host issue of an eager dense decoder (``training.fused_kernels = false``: no torch.compile,
one PyTorch op per step of every norm, activation, RoPE and residual add), in seconds.

Run eagerly, every op a layer runs goes through Python and PyTorch's dispatcher (binding,
dispatch, autograd recording, the allocator) before its kernel starts: microseconds of host
time per op whatever the tensor's size. Where the host is the device (a CPU:
``gpu_spec.host_is_device``) that time adds to the kernels'; on a GPU the host issues ahead,
and a pass costs more than its kernels only where the host takes longer to issue it
(max(kernels, host), as ``dtensor_host.host_excess_s``). Small micro-batches make it visible:
at 128 tokens a layer's GEMMs on a CPU core take a few milliseconds, its ~230 ops about two.

The ops are counted, not fitted: ``tests/perf/test_eager_host.py`` counts the aten ops of
aihpc's own trainer (runtime/model.py's decoder, the loss of runtime/step.py, its AdamW and
gradient clipping on plain tensors) with a dispatch mode and checks them against the constants
below. One op's cost is ``params.host_eager_op_s`` (8 us: an A100's host issuing an eager op;
on this project's 2-core CPU host the trainer's 2-layer decoder at width 16 and 4 tokens, where
the arithmetic is nothing, took 3.97 ms of CPU time for its 514 forward and backward ops, 7.7
us each, torch 2.13). DTensor's dispatch (``dtensor_host``) and an eager MoE layer
(``moe_host``) are priced on top of this, as the extra they add.
"""

from __future__ import annotations

from typing import Any

from aihpc.perf.step.dtensor_host import stage_tensors
from aihpc.perf.step.numeric import maximum
from aihpc.perf.step.params import ModelParams
from aihpc.runspec.cluster import GPUSpec
from aihpc.runspec.model import ModelSpec
from aihpc.runspec.training import TrainingSpec

__all__ = [
    "CLIP_OPS_PER_TENSOR",
    "DENSE_LAYER_OPS",
    "MOE_LAYER_OPS_FIXED",
    "MOE_LAYER_OPS_PER_EXPERT",
    "OPTIMIZER_FIXED_OPS",
    "OPTIMIZER_OPS_PER_TENSOR",
    "OUTSIDE_OPS",
    "eager",
    "eager_outside",
    "layer_host_s",
    "layer_ops",
    "moe_loop_copy_bytes",
    "optimizer_eager_host_s",
    "outside_host_s",
    "pass_excess_s",
    "ring_attention_bytes",
    "ring_extra_ops",
]

# One dense decoder layer, one micro-batch, plain tensors (torch 2.13): forward 83 aten ops (two
# RMSNorms in fp32, the q/k/v/o and SwiGLU linears, RoPE, the attention call, views and
# transposes, the residual adds), backward 147.
DENSE_LAYER_OPS = (83, 147)
# One MoE decoder layer (runtime/moe.py: the router's softmax, top-k and load counts, the
# dispatcher's sort, gather and scatter, one SwiGLU per local expert in a Python loop over
# ``split``, the combine's weighted ``index_add_``), one micro-batch, plain tensors, top-2:
# (forward, backward) = fixed + per local expert x E. Four experts: 189 forward, 230 backward,
# against the dense layer's 83 / 147; the per-expert loop adds 5 ops forward (three matmuls,
# the SiLU, the product) and 17 backward (their gradients and the split / unbind bookkeeping).
MOE_LAYER_OPS_FIXED = (169, 162)
MOE_LAYER_OPS_PER_EXPERT = (5, 17)
# Context parallelism: the trainer's ring attention (comm/ring.py) in place of one SDPA call,
# one layer and micro-batch, fp32 on a CPU, counted with a dispatch mode at cp 1 and 2 (torch
# 2.13): (forward, backward) aten ops = fixed + per ring step x cp, against SDPA's 2 and 8 (the
# call and its output's detach; the backward kernel and its three gradients' copies).
RING_OPS_FIXED, RING_OPS_PER_STEP, SDPA_OPS = (4, 10), (38, 59), (2, 8)
# Bytes its element-wise ops read and write (every op but the matmuls and views): per score
# element of the local queries against the whole sequence (the mask, log-sum-exp, exp,
# probabilities and dS passes over the fp32 scores) and per query element and ring step (the
# running output's and dQ's rescale and accumulate).
RING_BYTES_PER_SCORE, RING_BYTES_PER_Q_STEP = (36.3, 47.4), (38.0, 76.4)
# Outside the layers, one micro-batch: the embedding, the final norm, the output layer and the
# cross-entropy on fp32 logits.
OUTSIDE_OPS = (20, 34)
# One optimizer step on a CPU (AdamW's single-tensor loop: 7 ops a parameter tensor and the
# weight decay's multiply on each matrix, ``dtensor_host.ADAM_OPS``) plus the gradient clipping
# on plain tensors: a norm and a scale per gradient, and a few fixed ops (the stacked norms,
# the clip coefficient, zero_grad).
OPTIMIZER_OPS_PER_TENSOR = 7
CLIP_OPS_PER_TENSOR = 2
OPTIMIZER_FIXED_OPS = 17


def eager(training: TrainingSpec) -> bool:
    """Whether the dense layers are issued op by op from Python: unfused element-wise kernels
    (no torch.compile, no Megatron/TE fusions) and no CUDA graph said to replay them (``none``,
    or ``unknown``: unfused PyTorch is not captured in graphs unless a run says so)."""
    return not training.fused_kernels and training.cuda_graphs in ("none", "unknown")


def eager_outside(training: TrainingSpec) -> bool:
    """Whether what runs outside the decoder blocks (embedding, final norm, output layer, loss,
    the optimizer's loop) is issued op by op: under ``eager``, and under ``training.compile``
    too, which compiles each block and nothing else (runtime/speed.py, as torchtitan), unless a
    CUDA graph is said to replay the step."""
    compiled_blocks = training.compile and training.cuda_graphs in ("none", "unknown")
    return eager(training) or compiled_blocks


def pass_excess_s(kernels_s: Any, host_s: Any, gpu: GPUSpec) -> Any:
    """Seconds a pass whose kernels take ``kernels_s`` and whose host issue takes ``host_s``
    costs beyond its kernels: all of the host time where the host is the device, else what the
    host takes beyond the kernels."""
    if gpu.host_is_device:
        return host_s
    return maximum(0.0, host_s - kernels_s)


def layer_ops(local_experts: float | None = None) -> tuple[float, float]:
    """(forward, backward) eager ops of one decoder layer and micro-batch: dense, or an MoE
    layer with ``local_experts`` experts on this rank (its loop runs over those)."""
    if local_experts is None:
        return DENSE_LAYER_OPS
    fixed, per = MOE_LAYER_OPS_FIXED, MOE_LAYER_OPS_PER_EXPERT
    return fixed[0] + per[0] * local_experts, fixed[1] + per[1] * local_experts


def moe_loop_copy_bytes(
    model: ModelSpec, copies: float, local_experts: float, etp: int = 1
) -> tuple[float, float]:
    """(forward, backward) bytes read and written by the copies of the trainer's per-expert loop
    (runtime/moe.py ``GroupedExperts`` as it runs where the host is the device: the loop, fp32,
    4 bytes a value), one MoE layer and micro-batch with ``copies`` routed token copies on the
    rank. Forward: ``torch.cat`` of the experts' outputs (reads and writes copies x h).
    Backward: the ``split``'s gradient, a ``cat`` of the experts' input gradients (copies x h
    again), and the ``unbind``'s, a ``stack`` of each of w1, w3, w2's per-expert weight
    gradients (local experts x h x ffn each). The ``cat``'s own gradient is views (no copy)."""
    h, ffn = model.hidden_size, model.expert_ffn_hidden_size / etp
    tokens = 2 * copies * h * 4.0
    weights = 2 * 3 * local_experts * h * ffn * 4.0
    return tokens, tokens + weights


def ring_extra_ops(cp: int) -> tuple[float, float]:
    """(forward, backward) eager ops the ring attention of ``cp`` ranks issues beyond the SDPA
    call it replaces (none for cp 1: the trainer calls SDPA)."""
    if cp <= 1:
        return 0.0, 0.0
    fixed, per, sdpa = RING_OPS_FIXED, RING_OPS_PER_STEP, SDPA_OPS
    return fixed[0] + per[0] * cp - sdpa[0], fixed[1] + per[1] * cp - sdpa[1]


def ring_attention_bytes(
    tokens: float, heads: float, seq: int, head_dim: int, cp: int
) -> tuple[float, float]:
    """(forward, backward) element-wise bytes of the trainer's ring attention, one layer and
    micro-batch, ``tokens`` local queries of ``heads`` heads against ``seq`` keys."""
    score, q = tokens * heads * seq, tokens * heads * head_dim * cp
    f = RING_BYTES_PER_SCORE[0] * score + RING_BYTES_PER_Q_STEP[0] * q
    return f, RING_BYTES_PER_SCORE[1] * score + RING_BYTES_PER_Q_STEP[1] * q


def layer_host_s(
    training: TrainingSpec, params: ModelParams, local_experts: float | None = None, cp: int = 1
) -> tuple[float, float]:
    """(forward, backward) host issue of one eager layer and micro-batch (dense, or MoE with
    ``local_experts`` on this rank: ``layer_ops``; with ``cp`` > 1 the ring attention's own
    ops, ``ring_extra_ops``); 0 when fused."""
    if not eager(training):
        return 0.0, 0.0
    op_s = params.host_eager_op_s
    fwd, bwd = layer_ops(local_experts)
    ring_f, ring_b = ring_extra_ops(cp)
    return (fwd + ring_f) * op_s, (bwd + ring_b) * op_s


def outside_host_s(training: TrainingSpec, params: ModelParams) -> tuple[float, float]:
    """(forward, backward) host issue of the embedding, final norm, output layer and loss
    (``eager_outside``: eager ops, compiled blocks or not)."""
    if not eager_outside(training):
        return 0.0, 0.0
    op_s = params.host_eager_op_s
    return OUTSIDE_OPS[0] * op_s, OUTSIDE_OPS[1] * op_s


def optimizer_eager_host_s(
    layers: Any, pp: Any, tied: bool, gpu: GPUSpec, training: TrainingSpec, params: ModelParams
) -> Any:
    """Host issue of one optimizer step with clipping over the last stage's parameter tensors
    (``layers`` layers; ``dtensor_host.stage_tensors``), where the host is the device (a CPU:
    AdamW loops over the tensors in Python); on a GPU PyTorch's AdamW takes its foreach path,
    a few ops per parameter group, which this does not price. Compiling the blocks leaves the
    optimizer eager (``eager_outside``)."""
    if not gpu.host_is_device or not eager_outside(training):
        return 0.0 * layers
    count, matrices = stage_tensors(layers, pp, tied)
    ops = (OPTIMIZER_OPS_PER_TENSOR + CLIP_OPS_PER_TENSOR) * count + matrices
    return (ops + OPTIMIZER_FIXED_OPS) * params.host_eager_op_s
