"""Megatron's ``--log-params-norm`` (``training.log_params_norm``): the L2 norm of every parameter,
every iteration, in seconds.

``calc_params_l2_norm`` (``megatron/training/utils.py``, Megatron-LM at 93ebf8d) walks every
parameter of the model chunk, trained or frozen, and hands a list of tensors to one
``multi_tensor_l2norm`` launch. Under ``--bf16`` a parameter that has an fp32 main copy (one the
optimizer updates: ``param.main_param``) contributes that copy, which the norm reads (4 bytes a
parameter; under the distributed optimizer only this rank's shard of it, ``main_param_sharded``);
a parameter without one (frozen: no optimizer holds it) is copied to fp32 first
(``param.data.float()``: 2 bytes read, 4 written) and the copy read by the norm (4 more). Under
``--fp16`` or fp32 the parameter itself is read, 2 or 4 bytes. The copies are element-wise
traffic at the GPU's memory bandwidth (``gemm.stream_time_s``): one cast launch per frozen
tensor, the norm's own launches counted as one. The norm's two one-element all-reduces are not
priced (latency, once a step). Under ``training.deterministic`` (Megatron's
``--deterministic-mode``) the fp32 copy's allocation (``_to_copy``'s ``at::empty_strided``) is
filled with NaN before the cast writes it: 4 more bytes written per frozen parameter
(perf/step/deterministic_fill.py).

``tests/perf/test_params_norm.py`` checks ``norm_bytes`` against the bytes this description
gives, parameter kind by kind.
"""

from __future__ import annotations

from typing import Any

from aihpc.perf.step.gemm import stream_time_s
from aihpc.perf.step.params import ModelParams
from aihpc.runspec.cluster import GPUSpec
from aihpc.runspec.training import TrainingSpec

__all__ = [
    "DETERMINISTIC_COPY_FILL_BYTES",
    "FROZEN_BF16_BYTES",
    "MAIN_COPY_BYTES",
    "norm_bytes",
    "params_norm_s",
]

# A bf16 parameter with no fp32 main copy: read 2 (the cast), write 4 (the copy), read 4 (the
# norm).
FROZEN_BF16_BYTES = 2 + 4 + 4
# Under deterministic mode the fp32 copy is filled with NaN first: one more 4-byte write.
DETERMINISTIC_COPY_FILL_BYTES = 4
# A trained parameter's fp32 main copy, read by the norm.
MAIN_COPY_BYTES = 4


def _bf16(training: TrainingSpec) -> bool:
    """Megatron runs FP8 recipes with --bf16 as well; fp16 and fp32 read the parameter as is."""
    return training.precision in ("bf16", "fp8")


def norm_bytes(trained: Any, frozen: Any, shard: Any, training: TrainingSpec) -> Any:
    """Bytes one rank's norm moves over ``trained`` parameters (with a main copy, sharded
    ``shard`` ways under the distributed optimizer) and ``frozen`` ones (none)."""
    if _bf16(training):
        fill = DETERMINISTIC_COPY_FILL_BYTES if training.deterministic else 0
        return MAIN_COPY_BYTES * trained / shard + (FROZEN_BF16_BYTES + fill) * frozen
    per = 2 if training.precision == "fp16" else 4
    return per * (trained + frozen)


def params_norm_s(
    trained: Any,
    frozen: Any,
    shard: Any,
    tensors: Any,
    gpu: GPUSpec,
    training: TrainingSpec,
    params: ModelParams,
) -> Any:
    """Seconds of one iteration's parameter norm on a rank (0 unless ``log_params_norm``):
    ``norm_bytes`` at the memory bandwidth, a cast launch per frozen tensor (``tensors`` of
    them under bf16) and the norm's."""
    if not training.log_params_norm:
        return 0.0 * trained
    casts = tensors if _bf16(training) else 0
    return stream_time_s(
        norm_bytes(trained, frozen, shard, training), gpu, params, kernels=casts + 1
    )
