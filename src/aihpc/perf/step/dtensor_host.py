"""Host time of eager DTensor dispatch (``training.dtensor_dispatch = "eager"``), in seconds.

PyTorch-native tensor parallel (``parallelize_module``) and FSDP2 hold parameters as DTensors.
Run eagerly, every op on a DTensor goes through DTensor's dispatch in Python: unwrap the local
tensors, propagate the sharding (cached per op and input layout), redistribute where an input's
layout is not the one the op needs, run the local op, wrap the result. That costs tens of
microseconds of host time per op whatever the tensor's size; torch.compile traces it away
(torchtitan compiles each block), Megatron-Core has no DTensor in its layers.

The ops are counted, not fitted: ``tests/perf/test_dtensor_host.py`` counts the DTensor
dispatches of aihpc's own trainer (runtime/model.py's decoder under runtime/tp.py, the loss
parallel of runtime/step.py, its AdamW and gradient clipping) with a dispatch mode and checks
them against the constants below, for one and several layers, with and without sequence
parallel (torch 2.13). What one op costs is this host's: ``aihpc calibrate --local`` times the
trainer's tensor-parallel decoder on a one-rank mesh against the same decoder without DTensor
and divides by the counted ops (``calibration.dtensor_op_us``); ``params.dtensor_op_s``
otherwise.

Where the host is the device (a CPU: ``gpu_spec.host_is_device``) the host time adds to the
kernels'. On a GPU the host issues ahead of the kernels, and a pass costs more than its kernels
only where the host takes longer to issue it (``host_bound_s`` of perf/step/moe_host.py with no
sync: max(kernels, host)).
"""

from __future__ import annotations

from typing import Any

from aihpc.perf.step.numeric import maximum, where
from aihpc.perf.step.params import ModelParams
from aihpc.runspec.calibration import Calibration
from aihpc.runspec.cluster import GPUSpec

__all__ = [
    "LAYER_BWD_OPS",
    "LAYER_FWD_OPS",
    "OUTSIDE_BWD_OPS",
    "OUTSIDE_FWD_OPS",
    "clip_ops",
    "dtensor_op_s",
    "dtensor_optimizer_op_s",
    "dtensor_params",
    "host_excess_s",
    "optimizer_host_s",
    "optimizer_ops",
    "stage_tensors",
]

# One decoder layer of one micro-batch under tensor parallel (every weight a DTensor, the
# attention core and the SwiGLU product on local tensors between ColwiseParallel's local output
# and RowwiseParallel's input): forward 42 (the norms' element-wise ops on the replicated or
# sequence-sharded input, the linears' transposes, views and matmuls, the residual adds);
# backward 99, 102 with sequence parallel (the norms' weight gradients reduced from partial
# sums). Counted with torch 2.13.
LAYER_FWD_OPS = 42
LAYER_BWD_OPS = {False: 99, True: 102}
# Outside the layers, one micro-batch: the vocabulary-sharded embedding, the final norm, the
# vocabulary-sharded output layer and the loss parallel cross-entropy.
OUTSIDE_FWD_OPS = 16
OUTSIDE_BWD_OPS = 34
# PyTorch's AdamW runs its single-tensor loop on CPU tensors: 7 ops a parameter (mul_, lerp_,
# addcmul_, sqrt, div, add_, addcdiv_) and one more (the decoupled weight decay's mul_) for each
# matrix (the trainer decays matrices, not norm weights). On CUDA tensors it takes the foreach
# path, the same ops once per parameter group (two: with and without decay); not counted here,
# where no GPU runs.
ADAM_OPS = 7
PARAM_GROUPS = 2
# A dense decoder layer's parameter tensors (wq, wk, wv, wo, w1, w2, w3 and two norm weights),
# and of them matrices.
TENSORS_PER_LAYER = 9
MATRICES_PER_LAYER = 7


def dtensor_op_s(params: ModelParams, calibration: Calibration | None) -> float:
    """Host seconds one op on a DTensor costs beyond the plain op: this host's measurement when
    the calibration has one, else the model's constant."""
    measured = calibration.dtensor_op_us if calibration is not None else None
    return params.dtensor_op_s if measured is None else measured * 1e-6


def dtensor_optimizer_op_s(params: ModelParams, calibration: Calibration | None) -> float:
    """Host seconds one op of the optimizer step on DTensor parameters costs beyond the plain
    op: this host's measurement of the optimizer's ops when the calibration has one (AdamW's
    element-wise ops on a DTensor skip most of what a layer's op pays: no redistribution, one
    cached placement), else the layers' figure (``dtensor_op_s``)."""
    measured = calibration.dtensor_optimizer_op_us if calibration is not None else None
    return dtensor_op_s(params, calibration) if measured is None else measured * 1e-6


def host_excess_s(kernels_s: Any, ops: Any, op_s: float, gpu: GPUSpec) -> Any:
    """Seconds a pass of ``ops`` DTensor ops takes beyond its kernels' ``kernels_s``: all of the
    host time where the host is the device, else what the host takes beyond the kernels."""
    host = ops * op_s
    if gpu.host_is_device:
        return host
    return maximum(0.0, host - kernels_s)  # host_bound_s with no sync, over arrays of plans


def stage_tensors(layers: Any, pp: Any, tied: bool) -> tuple[Any, Any]:
    """(parameter tensors, of them matrices) of the last pipeline stage (the slowest one the
    model prices): its layers', the final norm's and the output layer's, and the embedding's
    when one stage holds all (tied: the output layer is the embedding)."""
    embedding = where(pp == 1, 0 if tied else 1, 0)
    matrices = MATRICES_PER_LAYER * layers + 1 + embedding
    return TENSORS_PER_LAYER * layers + 2 + embedding, matrices


def clip_ops(tp: Any, sp: Any) -> Any:
    """Gradient clipping: a norm per group of gradients with one (mesh, placements) and their
    stack (3 ops each), and one scale. Tensor parallel makes three groups (row-sharded,
    column-sharded, replicated norm weights), four with sequence parallel; FSDP2 alone one."""
    groups = where(tp > 1, 3 + where(sp, 1, 0), 1)
    return 3 * groups + 1


def optimizer_ops(tensors: tuple[Any, Any], tp: Any, sp: Any, gpu: GPUSpec) -> Any:
    """DTensor ops of one optimizer step over ``tensors`` (``stage_tensors``): AdamW's (per
    parameter on a CPU, per parameter group on a GPU) and the gradient clipping's."""
    count, matrices = tensors
    adam = ADAM_OPS * count + matrices if gpu.host_is_device else (ADAM_OPS + 1) * PARAM_GROUPS
    return adam + clip_ops(tp, sp)


def dtensor_params(tp: Any, dp: Any, cp: Any, pp: Any, zero: Any, ep: Any) -> Any:
    """Whether the parameters are DTensors: under tensor parallel, and wherever FSDP2 wraps the
    model (more than one data- or context-parallel rank, except a data-parallel-only plan at
    ZeRO 0 without experts, which runs DDP on plain tensors; runtime/parallelize.py)."""
    not_ddp = (pp > 1) | (tp > 1) | (cp > 1) | (zero > 0) | (ep > 1)
    return (tp > 1) | ((dp * cp > 1) & not_ddp)


def optimizer_host_s(
    opt_s: Any,
    b: Any,
    layers: Any,
    tied: bool,
    gpu: GPUSpec,
    params: ModelParams,
    calibration: Calibration | None,
) -> Any:
    """The optimizer step's DTensor host time beyond its kernels ``opt_s``, for plan(s) ``b``
    (a PlanBatch) whose last stage holds ``layers`` layers."""
    on = dtensor_params(b.tp, b.dp, b.cp, b.pp, b.zero, b.ep)
    ops = optimizer_ops(stage_tensors(layers, b.pp, tied), b.tp, b.sp, gpu)
    extra = host_excess_s(opt_s, ops, dtensor_optimizer_op_s(params, calibration), gpu)
    return where(on, extra, 0.0)
