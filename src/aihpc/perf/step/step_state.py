"""The figures every step-time term reads, for one plan (``PlanBatch.of``: plain Python numbers) or
numpy arrays of plans: the specs, the plans, the layer times the search shapes (``Shapes``), the
micro-batches per step, the layers per stage, and the communication model's collective time.
The terms themselves are methods of ``batch_step.StepTerms`` (compute, TP / CP / EP, bubble,
optimizer) and functions of ``dp_comm`` (data-parallel communication), both over this state.
"""

from __future__ import annotations

from typing import Any

from aihpc.perf.step import comm
from aihpc.perf.step.batch_shapes import Shapes
from aihpc.perf.step.params import ModelParams
from aihpc.perf.step.plan_batch import FULL, PlanBatch
from aihpc.runspec.cluster import ClusterSpec
from aihpc.runspec.model import ModelSpec
from aihpc.runspec.training import TrainingSpec

__all__ = ["StepState"]


class StepState:
    """The inputs and shared figures of one plan's or an array of plans' step-time terms."""

    def __init__(
        self,
        model: ModelSpec,
        cluster: ClusterSpec,
        training: TrainingSpec,
        params: ModelParams,
        b: PlanBatch,
        shapes: Shapes,
        memo: dict[tuple, Any] | None = None,
    ) -> None:
        self.model, self.cluster, self.training, self.params = model, cluster, training, params
        self.b, self.sh, self.memo = b, shapes, memo
        self.m = b.global_batch_size // (b.dp * b.mbs)
        # Multi-token-prediction modules run as one more layer each (Megatron-Bridge's
        # DeepSeek-V3 pipeline layouts give the MTP module a layer's slot on the last stage).
        self.layers = -(-(model.num_layers + model.mtp_layers) // (b.pp * b.vpp)) * b.vpp
        self.moe_frac = model.num_moe_layers / model.num_layers if model.is_moe else 0.0
        self.full = b.rec == FULL
        self.fwd_layer, self.bwd_layer = shapes["fwd"], shapes["bwd"]
        self.recompute_layer = shapes.by_rec(shapes.rec, b.rec)
        self.lfwd, self.lbwd = shapes["lfwd"], shapes["lbwd"]

    def collective(self, kind: str, size: Any, n: Any, stride: Any) -> Any:
        """comm.collective_time_s, over arrays or (memoised for the caller) for one plan."""
        if not self.b.one:
            return comm.collective_times_s(self.cluster, kind, size, n, stride, self.params)
        key = ("collective", kind, size, n, stride)
        hit = self.memo.get(key) if self.memo is not None else None
        if hit is None:
            hit = comm.collective_time_s(self.cluster, kind, size, n, stride, self.params)
            if self.memo is not None:
                self.memo[key] = hit
        return hit
