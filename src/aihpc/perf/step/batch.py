"""Price many plans at once: the step-time terms and the memory total of ``estimate_plan`` over
numpy arrays of plans (one element per plan), for the search.

The arithmetic is ``estimate_plan``'s, term by term and in the same order of operations, so each
plan's step time is the same float; what depends only on a few plan fields (the kernel times of a
(tp, cp, micro-batch, SP, ep, etp) shape, the tensor- and context-parallel exchanges, the MoE
dispatch, the saved activations) is computed once per distinct value by the scalar functions of
``compute``, ``comm`` and ``memory`` and gathered into the arrays. The data-parallel collectives,
whose sizes vary with every stage split, run as array formulas (``comm.collective_times_s``).
tests/perf/test_search_fast.py holds the two paths to equal results.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aihpc.perf.step.batch_memory import memory_total
from aihpc.perf.step.batch_shapes import Shapes
from aihpc.perf.step.batch_step import StepTerms
from aihpc.perf.step.memory import GiB
from aihpc.perf.step.params import ModelParams
from aihpc.perf.step.plan_batch import FULL, OP, PlanBatch, group
from aihpc.runspec.cluster import ClusterSpec
from aihpc.runspec.errors import SpecError
from aihpc.runspec.model import ModelSpec
from aihpc.runspec.training import TrainingSpec

__all__ = ["FULL", "OP", "BatchTimes", "PlanBatch", "group", "price_batch"]


@dataclass(frozen=True)
class BatchTimes:
    """What the search ranks and filters on, one element per plan."""

    step_time_s: np.ndarray
    tokens_per_s_per_gpu: np.ndarray
    memory_total: np.ndarray  # bytes on the most loaded GPU
    offloaded: np.ndarray  # bytes of activations in host memory
    fits: np.ndarray
    act_layer: np.ndarray  # activation bytes one layer keeps, per micro-batch


def price_batch(
    model: ModelSpec,
    cluster: ClusterSpec,
    b: PlanBatch,
    training: TrainingSpec,
    params: ModelParams,
) -> BatchTimes:
    """Step time, throughput and memory of every plan in ``b`` (``estimate_plan``'s figures)."""
    if b.offload.any() and cluster.gpu.host_link_GBps is None:
        raise SpecError("cluster.gpu_spec.host_link_GBps", None, "required to offload")
    if not len(b):
        empty = np.zeros(0)
        return BatchTimes(empty, empty, empty, empty, np.zeros(0, dtype=bool), empty)
    shapes = Shapes(b, model, cluster, training, params)
    st = StepTerms(model, cluster, training, params, b, shapes)
    step = st.step_time()
    tokens_step = b.global_batch_size * model.seq_length
    total, offloaded, act_layer = memory_total(model, training, params, b, shapes)
    fits = total <= cluster.usable_hbm_gib * GiB
    if cluster.gpu.host_mem_gib is not None:
        fits &= offloaded <= cluster.gpu.host_mem_gib * GiB
    return BatchTimes(
        step_time_s=step,
        tokens_per_s_per_gpu=tokens_step / step / cluster.num_gpus,
        memory_total=total,
        offloaded=offloaded,
        fits=fits,
        act_layer=act_layer,
    )
