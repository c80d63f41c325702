"""Host time of an eager vision encoder (``training.fused_kernels = false``: aihpc's own trainer,
runtime/vlm/), in seconds: its ops issued one by one from Python, its optimizer step's loop over
its parameter tensors, and, under ZeRO-3, the gathers of its blocks (each block an FSDP unit).

The encoder's arithmetic (encoder.py) is a small part of a small encoder's time on a CPU: the
trainer's 2-layer ViT of width 32 runs a micro-batch of five 16-patch images forward and
backward in about 0.6 ms of kernels at its host's calibrated rates, while it issues 261 aten ops
(2 ms at 8 us an op), its 33 parameter tensors add 309 ops to the optimizer step (243 of them on
DTensors under FSDP2), and under FSDP2 its two blocks add four all-gathers a micro-batch and two
reduce-scatters a step (1.7-3.8 ms each as this project's loaded 2-core host calibrates gloo).

**Ops, counted not fitted.** The trainer encodes a micro-batch's images in one batched call
(model.py ``VisionLlama.embed``: the real images picked out of their slots by one boolean index,
the projected tokens put in the placeholders' places by one ``masked_scatter``), so the ops are
the same whatever the number of images: per encoder block and per micro-batch, plus a fixed part
(the patchify views, the patch embedding, the position table, the final norm, the projector, the
image selection and scatter, and what the text-only loss adds to the decoder's cross-entropy).
``tests/perf/test_encoder_host.py`` counts the aten ops of the trainer's VisionLlama with a
dispatch mode (forward with text_loss, backward, one clipped AdamW step, on plain tensors),
subtracts the decoder's (perf/step/eager_host.py's constants) and checks what is left against the
constants below, at 1 and 2 encoder blocks, 1 to 6 images, with and without the projector's
hidden layer and with ``encoder_recompute = "full"`` (torch 2.13). A micro-batch with no image at
all still calls the encoder on an empty batch (11 ops more forward, the empty attention's path):
not priced, a micro-batch of text only is rare where images are the point.

**Cost per op.** ``params.host_eager_op_s`` per op, as eager_host.py prices the decoder's. On a
CPU (``gpu_spec.host_is_device``) it adds to the encoder's kernels; on a GPU a micro-batch's
encoder costs max(kernels, host issue) (eager_host.pass_excess_s), which for a CLIP or SigLIP
tower on hundreds of patches an image is its kernels. An optimizer op on a DTensor parameter
(FSDP2's Shard(0), or the encoder's Replicate weights under TP) costs ``OPTIMIZER_DTENSOR_OP_S``
more: in-place element-wise ops on a one-rank mesh's Shard(0) DTensor against the same ops on
plain tensors on this project's 2-core Xeon host (torch 2.13, load average 3.5): 12.7 us more an
op for ``mul_`` / ``addcmul_`` of 32 x 32 and 96 x 32 fp32 values, 17 us for AdamW's 8 ops a
parameter over 33 such parameters; 14 us is taken. That is not ``dtensor_op_us``: the
calibration times the tensor-parallel decoder's ops (sharding propagation of matmuls,
redistributions), 50-104 us on the same host.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import numpy as np

from aihpc.perf.multimodal.encoder import layer_params
from aihpc.perf.multimodal.imbalance import Grid
from aihpc.perf.step import dtensor_host, eager_host, fsdp_host
from aihpc.perf.step.comm import collective_time_s
from aihpc.perf.step.memory import DTYPE_BYTES
from aihpc.perf.step.params import ModelParams
from aihpc.runspec.cluster import ClusterSpec, GPUSpec
from aihpc.runspec.parallel import ParallelPlan
from aihpc.runspec.training import TrainingSpec
from aihpc.runspec.vision import MultimodalSpec, VisionSpec

__all__ = [
    "BLOCK_MATRICES",
    "BLOCK_OPS",
    "BLOCK_RECOMPUTE_OPS",
    "BLOCK_TENSORS",
    "FIXED_MATRICES",
    "FIXED_OPS",
    "FIXED_TENSORS",
    "OPTIMIZER_DTENSOR_OP_S",
    "PROJECTOR_HIDDEN_OPS",
    "EncoderComm",
    "encoder_ops",
    "encoder_tensors",
    "fsdp_comm_s",
    "fsdp_gather_host_s",
    "host_ops_s",
    "micro_batch_host_s",
    "optimizer_host_s",
    "with_host",
]

# One encoder block (pre-norm attention with a fused qkv linear and SDPA, a GELU MLP, biases),
# one micro-batch, plain fp32 tensors: (forward, backward) aten ops, whatever its images.
BLOCK_OPS = (28, 65)
# The same block under encoder_recompute = "full" (torch.utils.checkpoint, non-reentrant): the
# forward saves nothing (one op fewer), the backward runs the forward again.
BLOCK_RECOMPUTE_OPS = (27, 126)
# Outside the blocks, with a one-linear projector: the patchify views, the patch embedding and
# position table, the final LayerNorm, the projector, picking the real images out of their slots,
# the scatter of their tokens into the sequence, and text_loss beyond the decoder's loss.
FIXED_OPS = (27, 30)
# A two-layer projector (projector_hidden > 0) adds a linear layer and a GELU.
PROJECTOR_HIDDEN_OPS = (5, 13)
# Parameter tensors, and of them matrices (AdamW decays matrices): a block's two LayerNorms'
# weights and biases and four linears' weights and biases; outside, the patch embedding's weight
# and bias, the position table, the final LayerNorm's two and the projector's weight and bias
# (a two-layer projector: two more, one a matrix).
BLOCK_TENSORS, BLOCK_MATRICES = 12, 4
FIXED_TENSORS, FIXED_MATRICES = 7, 3
PROJECTOR_HIDDEN_TENSORS, PROJECTOR_HIDDEN_MATRICES = 2, 1
# What an in-place element-wise op on a DTensor parameter adds to the plain op (module docstring).
OPTIMIZER_DTENSOR_OP_S = 14e-6


def encoder_ops(v: VisionSpec, mm: MultimodalSpec) -> tuple[int, int]:
    """(forward, backward) aten ops of the encoder and projector for one micro-batch, any
    number of images."""
    block = BLOCK_RECOMPUTE_OPS if mm.encoder_recompute == "full" else BLOCK_OPS
    fwd = v.num_layers * block[0] + FIXED_OPS[0]
    bwd = v.num_layers * block[1] + FIXED_OPS[1]
    if v.projector_hidden:
        fwd, bwd = fwd + PROJECTOR_HIDDEN_OPS[0], bwd + PROJECTOR_HIDDEN_OPS[1]
    return fwd, bwd


def encoder_tensors(v: VisionSpec) -> tuple[int, int]:
    """(parameter tensors, of them matrices) of the encoder and projector."""
    count = v.num_layers * BLOCK_TENSORS + FIXED_TENSORS
    matrices = v.num_layers * BLOCK_MATRICES + FIXED_MATRICES
    if v.projector_hidden:
        count, matrices = count + PROJECTOR_HIDDEN_TENSORS, matrices + PROJECTOR_HIDDEN_MATRICES
    return count, matrices


def host_ops_s(
    v: VisionSpec, mm: MultimodalSpec, training: TrainingSpec, params: ModelParams
) -> tuple[float, float]:
    """(forward, backward) host issue of one micro-batch's encoder and projector: the backward
    of what is trained (a frozen encoder under a trained projector: the fixed part's backward);
    0 when the encoder is not run eagerly (compiled, fused, CUDA graphs)."""
    if not eager_host.eager(training):
        return 0.0, 0.0
    fwd, bwd = encoder_ops(v, mm)
    if mm.freeze_encoder:
        bwd = 0 if mm.freeze_projector else FIXED_OPS[1]
        bwd += PROJECTOR_HIDDEN_OPS[1] if v.projector_hidden and not mm.freeze_projector else 0
    return fwd * params.host_eager_op_s, bwd * params.host_eager_op_s


def micro_batch_host_s(
    v: VisionSpec, mm: MultimodalSpec, training: TrainingSpec, params: ModelParams
) -> float:
    """Host issue of one micro-batch's encoder and projector, forward and backward."""
    return sum(host_ops_s(v, mm, training, params))


def fsdp_gather_host_s(
    v: VisionSpec, mm: MultimodalSpec, plan: ParallelPlan, training: TrainingSpec, gpu: GPUSpec
) -> tuple[float, float]:
    """(forward, backward) host seconds of one micro-batch's encoder-block all-gathers on a GPU
    under eager FSDP2 (each block a unit of BLOCK_TENSORS tensors; fsdp_host.gather_host_s): one
    before each block's forward, and under ZeRO 3 one before a trained block's backward. 0 where
    the host is the device (its collectives' calibration holds them) or without FSDP2."""
    wrapped = fsdp_host.fsdp_wrapped(plan.tp, plan.dp, plan.cp, plan.pp, plan.zero_stage)
    if training.dtensor_dispatch != "eager" or gpu.host_is_device or not bool(wrapped):
        return 0.0, 0.0
    g_f, g_b = fsdp_host.unit_gathers(plan.zero_stage, plan.pp)
    one = v.num_layers * fsdp_host.gather_host_s(BLOCK_TENSORS)
    return float(g_f * one), float(g_b * one) if not mm.freeze_encoder else 0.0


def with_host(mb: Grid, host_s: float, gpu: GPUSpec) -> Grid:
    """A micro-batch's encoder seconds with its host issue: added where the host is the device,
    else max(kernels, host) (the same distribution where every micro-batch's kernels are longer)."""
    if host_s <= 0.0:
        return mb
    if gpu.host_is_device:
        return replace(mb, lo=mb.lo + host_s)
    values = mb.values
    if values[-1] < host_s:  # every micro-batch waits on its host
        return Grid.point(host_s)
    # the micro-batches whose kernels are shorter move to the first point at or above host_s
    # (on the same grid: where none is shorter the distribution is unchanged)
    below = values < host_s
    if not below.any():
        return mb
    p = mb.p.copy()
    first = int(np.argmax(~below))
    p[first] += p[below].sum()
    p[below] = 0.0
    return replace(mb, p=p)


def optimizer_host_s(
    v: VisionSpec,
    plan: ParallelPlan,
    gpu: GPUSpec,
    training: TrainingSpec,
    params: ModelParams,
) -> float:
    """What the encoder's parameters add to an eager optimizer step where the host is the device
    (AdamW's per-tensor loop and the clipping's per-tensor norm and scale, as
    eager_host.optimizer_eager_host_s prices the decoder's), with each of AdamW's ops on a DTensor
    parameter costing OPTIMIZER_DTENSOR_OP_S more; on a GPU AdamW takes its foreach path (not
    priced, as for the decoder)."""
    if not gpu.host_is_device or not eager_host.eager(training):
        return 0.0
    count, matrices = encoder_tensors(v)
    per_tensor = eager_host.OPTIMIZER_OPS_PER_TENSOR + eager_host.CLIP_OPS_PER_TENSOR
    host = (per_tensor * count + matrices) * params.host_eager_op_s
    fsdp = dtensor_host.dtensor_params(plan.tp, plan.dp, plan.cp, plan.pp, plan.zero_stage, 1)
    if training.dtensor_dispatch == "eager" and bool(fsdp):
        host += (dtensor_host.ADAM_OPS * count + matrices) * OPTIMIZER_DTENSOR_OP_S
    return host


class EncoderComm(NamedTuple):
    """A step's encoder-block collectives: exposed and hidden seconds, and of the exposed those
    before the forwards (the gathers a forward waits on)."""

    exposed: float
    hidden: float
    forward: float


def fsdp_comm_s(
    v: VisionSpec,
    cluster: ClusterSpec,
    plan: ParallelPlan,
    training: TrainingSpec,
    params: ModelParams,
    m: int,
    window_s: float,
) -> EncoderComm:
    """The seconds a step spends on the encoder blocks' own ZeRO-3 collectives
    (FSDP2, each block a unit; not DeepSpeed's per-tensor gathers, ``zero3_gather =
    "per_tensor"``): without PP, per micro-batch an all-gather of each block before its forward
    and again before its backward, hidden behind ``window_s`` (the overlap efficiency's share of
    a micro-batch's encoder seconds) where they can, and each block's gradient reduce-scatter
    once a step, after the last micro-batch (FSDP2 under set_requires_gradient_sync, as the
    trainer runs it; it waits on the critical path); under PP the blocks stay gathered over the
    step: one gather and one reduce-scatter each. The encoder's other weights join the root
    unit's collectives (their bytes not priced here); ZeRO 0-2 put the encoder's gradients in
    the decoder's bucketed reductions (not priced here either)."""
    shard = (plan.dp_shard or plan.dp) * plan.cp
    if plan.zero_stage != 3 or training.zero3_gather == "per_tensor" or shard <= 1:
        return EncoderComm(0.0, 0.0, 0.0)
    # a block's weights: layer_params' matrices and norm weights, and the trainer's biases (the
    # norms' 2h, the linears' 3h + h + f + h)
    n = layer_params(v) + 7 * v.hidden_size + v.ffn_hidden_size
    gather_fp32 = training.param_dtype == "fp32" or (
        training.param_dtype == "auto" and cluster.gpu.host_is_device
    )
    weights = (4.0 if gather_fp32 else 2.0) * n
    grads = DTYPE_BYTES[training.grad_reduce_dtype] * n

    def coll(kind: str, size: float) -> float:
        return collective_time_s(cluster, kind, size, shard, plan.tp, params)

    ag, rs = coll("all_gather", weights), coll("reduce_scatter", grads)
    blocks = v.num_layers
    if plan.pp > 1:
        return EncoderComm(blocks * (ag + rs), 0.0, blocks * ag)
    per_mb = blocks * 2 * ag
    exposed = max(0.0, per_mb - window_s)
    return EncoderComm(m * exposed + blocks * rs, m * (per_mb - exposed), m * exposed / 2)
