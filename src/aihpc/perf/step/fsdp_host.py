"""PyTorch-native FSDP2 as it runs eagerly (``training.dtensor_dispatch = "eager"``: aihpc's own
trainer, runtime/parallelize.py), beyond its collectives: its units and the copies around each
gather and reduction.

The trainer wraps each decoder layer in an FSDP2 unit and the rest (embedding, final norm,
output layer) in a root unit, for ZeRO 1 and 2 (``reshard_after_forward=False``) as for ZeRO 3.
Each unit gathers its parameters and reduce-scatters its gradients with collectives of its own,
so a step makes one gather per unit and micro-batch under ZeRO 1/2 (the parameters stay
gathered from the forward to the backward and are resharded after it), two under ZeRO 3
(forward and backward), and one reduce-scatter per unit, after the last micro-batch's
backward (the trainer syncs gradients on the last micro-batch only,
``set_requires_gradient_sync``).

Around each collective FSDP2 copies, on the training thread (torch 2.13,
``torch.distributed.fsdp._fully_shard._fsdp_collectives``):

- gather: ``all_gather_copy_in`` copies this rank's shards into the all-gather's input
  (reads and writes the shard), ``split_with_sizes_copy`` copies the gathered buffer out into
  the unsharded parameters (reads and writes the whole unit);
- reduction: ``chunk_cat`` copies the unsharded gradients into the reduce-scatter's input
  (reads and writes every gradient), and the output shard is copied into the sharded gradient
  (``copy_``: reads and writes the shard).

On a GPU the copies are kernels; what the host spends issuing each unit's gather (FSDP2's
Python around it: the per-parameter bookkeeping, the copy-in's and copy-out's setup, stream
and event handling) is host time that adds to the layer's issue (``gather_host_s``): the
published profile of one Llama3-8B block's all-gather (``data/fsdp_host_figures.csv``),
per parameter tensor of the unit. The rest of FSDP2's hooks (pre-forward's input casts,
post-forward's reshard, post-backward's reduce-scatter) have no published figure here and are
not priced.

Megatron-Core's distributed optimizer gathers into and reduces out of its contiguous buffers in
place (no such copies), which is what the model prices without eager FSDP2.

The bytes are counted, not fitted: ``tests/perf/test_fsdp_host.py`` counts these ops of the
trainer's own step on two gloo ranks with a dispatch mode (ZeRO 1 and 3, two micro-batches) and
checks them and the collectives per unit against ``copy_bytes`` and ``collectives``. They are
priced as element-wise traffic at the host's memory bandwidth (``gemm.stream_time_s``), one
kernel launch per copy.
"""

from __future__ import annotations

import csv
import functools
from importlib import resources
from typing import Any

from aihpc.perf.step.gemm import stream_time_s
from aihpc.perf.step.numeric import where
from aihpc.perf.step.params import ModelParams
from aihpc.runspec.cluster import GPUSpec
from aihpc.runspec.training import TrainingSpec

__all__ = [
    "COPIES_PER_GATHER",
    "COPIES_PER_REDUCE",
    "COPY_OPS",
    "collectives",
    "copy_bytes",
    "copy_time_s",
    "eager_fsdp",
    "fsdp_wrapped",
    "gather_class",
    "gather_host_s",
    "unit_gathers",
]

# Copies per unit: a gather's copy-in and copy-out, a reduction's chunk_cat and shard copy.
COPIES_PER_GATHER = 2
COPIES_PER_REDUCE = 2
# The aten ops that make them (torch 2.13).
COPY_OPS = ("all_gather_copy_in", "split_with_sizes_copy", "chunk_cat", "copy_")


def eager_fsdp(training: TrainingSpec) -> bool:
    """Whether ZeRO 1-3 run as PyTorch-native FSDP2, eagerly (``dtensor_dispatch`` eager)."""
    return training.dtensor_dispatch == "eager"


def collectives(layers: Any, m: Any, zero: Any, pp: Any = 1) -> tuple[Any, Any, Any]:
    """(units, gathers per unit, reduce-scatters per unit) of one step with ``layers`` layers on
    the stage and ``m`` micro-batches: a unit per layer and the root; a gather per micro-batch
    (two under ZeRO 3), under ZeRO 1/2 with PP one a step (torch.distributed.pipelining keeps
    the units gathered over the micro-batches: ``set_reshard_after_backward(False)``); one
    reduce-scatter."""
    per_mb = where(pp > 1, 1, m)
    return layers + 1, where(zero == 3, 2 * m, per_mb), 1


def copy_bytes(param_bytes: Any, grad_bytes: Any, shard_n: Any, gathers: Any, reduces: Any) -> Any:
    """Bytes FSDP2's copies read and write in one step over all units of a stage that gathers
    ``param_bytes`` and reduces ``grad_bytes`` over ``shard_n`` ranks, ``gathers`` and
    ``reduces`` times: per gather the shard in (2 x param_bytes / shard_n) and the whole out
    (2 x param_bytes); per reduction the gradients in (2 x grad_bytes) and the shard out
    (2 x grad_bytes / shard_n)."""
    gather = 2.0 * param_bytes / shard_n + 2.0 * param_bytes
    reduce = 2.0 * grad_bytes + 2.0 * grad_bytes / shard_n
    return gathers * gather + reduces * reduce


def copy_time_s(
    param_bytes: Any,
    grad_bytes: Any,
    shard_n: Any,
    layers: Any,
    m: Any,
    zero: Any,
    gpu: GPUSpec,
    params: ModelParams,
    pp: Any = 1,
) -> Any:
    """Seconds of FSDP2's copies in one step (``copy_bytes`` at the memory bandwidth, a launch
    per copy per unit)."""
    units, gathers, reduces = collectives(layers, m, zero, pp)
    num_bytes = copy_bytes(param_bytes, grad_bytes, shard_n, gathers, reduces)
    kernels = units * (COPIES_PER_GATHER * gathers + COPIES_PER_REDUCE * reduces)
    return stream_time_s(num_bytes, gpu, params, kernels=kernels)


@functools.cache
def _gather_us_per_tensor() -> float:
    """The used all-gather figure of ``data/fsdp_host_figures.csv``, per parameter tensor."""
    text = resources.files("aihpc.perf.step").joinpath("data/fsdp_host_figures.csv").read_text()
    (row,) = [r for r in csv.DictReader(text.splitlines()) if r["used"] == "true"]
    return float(row["host_us"]) / float(row["tensors"])


def gather_host_s(tensors: Any) -> Any:
    """Host seconds of one FSDP2 all-gather of a unit of ``tensors`` parameter tensors."""
    return tensors * _gather_us_per_tensor() * 1e-6


def unit_gathers(zero: Any, pp: Any) -> tuple[Any, Any]:
    """(forward, backward) all-gathers of one unit per micro-batch (``collectives``): one before
    each forward, and before each backward under ZeRO 3; under ZeRO 1/2 with PP one a step (not
    counted per micro-batch)."""
    fwd = where((zero == 3) | (pp == 1), 1, 0)
    return fwd, where(zero == 3, 1, 0)


def fsdp_wrapped(tp: Any, dp: Any, cp: Any, pp: Any, zero: Any, ep: Any = 1) -> Any:
    """Whether FSDP2 wraps the layers (more than one data- or context-parallel rank, except a
    data-parallel-only plan at ZeRO 0 without experts, which runs DDP: the condition of
    ``dtensor_host.dtensor_params`` less tensor parallel alone)."""
    not_ddp = (pp > 1) | (tp > 1) | (cp > 1) | (zero > 0) | (ep > 1)
    return (dp * cp > 1) & not_ddp


def gather_class(b: Any, training: TrainingSpec, gpu: GPUSpec) -> Any:
    """For plan(s) ``b`` (a PlanBatch), the layer's gather host issue class: 0 none (no eager
    FSDP2, or the host is the device), else 1 + the backward gathers per micro-batch. The layer
    times depend on it beside the plan's shape (batch_shapes.py groups plans by it)."""
    if training.dtensor_dispatch != "eager" or gpu.host_is_device:
        return 0 * b.tp
    g_f, g_b = unit_gathers(b.zero, b.pp)
    on = fsdp_wrapped(b.tp, b.dp, b.cp, b.pp, b.zero, b.ep) & (g_f > 0)
    return where(on, 1 + g_b, 0)
