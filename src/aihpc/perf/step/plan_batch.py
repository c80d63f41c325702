"""Plans as columns of numpy arrays, and grouping plans that share a few fields.

The search prices tens of thousands of plans at once (batch.py); a ``PlanBatch`` holds one array
per field the search varies and a scalar for the fields every plan shares. ``PlanBatch.of(plan)``
is one plan with plain Python numbers in its columns: the same step-time terms price it
(``estimate_plan``), on Python arithmetic (numeric.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aihpc.perf.step.flops import expert_params_per_layer, params_per_layer
from aihpc.perf.step.numeric import where
from aihpc.runspec.model import ModelSpec
from aihpc.runspec.parallel import MOE_A2A_OVERLAPS, RECOMPUTE, ParallelPlan

__all__ = ["FULL", "OP", "PlanBatch", "group", "layer_params_split", "subgroup"]

FULL, SELECTIVE, OP = RECOMPUTE.index("full"), RECOMPUTE.index("selective"), RECOMPUTE.index("op")
A2A_NONE, A2A_1F1B = MOE_A2A_OVERLAPS.index("none"), MOE_A2A_OVERLAPS.index("1f1b")
A2A_DUALPIPE = MOE_A2A_OVERLAPS.index("dualpipe")


@dataclass(frozen=True)
class PlanBatch:
    """Plans as columns: integer arrays of degrees, ``rec`` an index into RECOMPUTE, ``a2a`` into
    MOE_A2A_OVERLAPS; the fields every plan of a search shares are scalars."""

    tp: np.ndarray
    pp: np.ndarray
    vpp: np.ndarray
    cp: np.ndarray
    dp: np.ndarray
    ep: np.ndarray
    etp: np.ndarray
    sp: np.ndarray
    zero: np.ndarray
    rec: np.ndarray
    mbs: np.ndarray
    a2a: np.ndarray
    offload: np.ndarray
    global_batch_size: int
    pp_schedule: str | None = None
    dp_shard: int | None = None
    recompute_modules: tuple[str, ...] = ()

    # One plan of plain Python numbers (``of``), not arrays of plans; that plan.
    one: bool = field(init=False, repr=False, compare=False)
    source: ParallelPlan | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "one", not isinstance(self.tp, np.ndarray))

    @classmethod
    def of(cls, plan: ParallelPlan) -> PlanBatch:
        """One plan, its columns plain Python numbers (``one`` is true)."""
        return cls(
            plan.tp,  # type: ignore[arg-type]
            plan.pp,  # type: ignore[arg-type]
            plan.vpp,  # type: ignore[arg-type]
            plan.cp,  # type: ignore[arg-type]
            plan.dp,  # type: ignore[arg-type]
            plan.ep,  # type: ignore[arg-type]
            plan.etp,  # type: ignore[arg-type]
            plan.sequence_parallel,  # type: ignore[arg-type]
            plan.zero_stage,  # type: ignore[arg-type]
            RECOMPUTE.index(plan.recompute),  # type: ignore[arg-type]
            plan.micro_batch_size,  # type: ignore[arg-type]
            MOE_A2A_OVERLAPS.index(plan.moe_a2a_overlap),  # type: ignore[arg-type]
            plan.offload_layers,  # type: ignore[arg-type]
            plan.global_batch_size,
            plan.pp_schedule,
            plan.dp_shard,
            plan.recompute_modules,
            source=plan,
        )

    def zeros(self) -> float | np.ndarray:
        """A zero for every plan: 0.0 for one plan."""
        return 0.0 if self.one else np.zeros(len(self.tp))

    def __len__(self) -> int:
        return len(self.tp)

    def take(self, idx: np.ndarray) -> PlanBatch:
        cols = {f: getattr(self, f)[idx] for f in _COLUMNS}
        return PlanBatch(
            **cols,
            global_batch_size=self.global_batch_size,
            pp_schedule=self.pp_schedule,
            dp_shard=self.dp_shard,
            recompute_modules=self.recompute_modules,
        )

    def with_offload(self, offload: np.ndarray) -> PlanBatch:
        cols = {f: getattr(self, f) for f in _COLUMNS if f != "offload"}
        return PlanBatch(
            **cols,
            offload=offload,
            global_batch_size=self.global_batch_size,
            pp_schedule=self.pp_schedule,
            dp_shard=self.dp_shard,
            recompute_modules=self.recompute_modules,
        )

    def plan(self, i: int = 0) -> ParallelPlan:
        """The i-th plan as a ParallelPlan (for one plan: that plan)."""
        if self.source is not None:
            return self.source
        return ParallelPlan(
            tp=int(self.tp[i]),
            pp=int(self.pp[i]),
            vpp=int(self.vpp[i]),
            cp=int(self.cp[i]),
            dp=int(self.dp[i]),
            ep=int(self.ep[i]),
            etp=int(self.etp[i]),
            moe_a2a_overlap=MOE_A2A_OVERLAPS[int(self.a2a[i])],
            sequence_parallel=bool(self.sp[i]),
            zero_stage=int(self.zero[i]),
            recompute=RECOMPUTE[int(self.rec[i])],
            micro_batch_size=int(self.mbs[i]),
            global_batch_size=self.global_batch_size,
            offload_layers=int(self.offload[i]),
            pp_schedule=self.pp_schedule,
            dp_shard=self.dp_shard,
            recompute_modules=self.recompute_modules,
        )


_COLUMNS = ("tp", "pp", "vpp", "cp", "dp", "ep", "etp", "sp", "zero", "rec", "mbs", "a2a")
_COLUMNS = (*_COLUMNS, "offload")


def group(*cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the index of one plan of each distinct row of ``cols``, each plan's row number). The
    columns hold non-negative integers (degrees, counts, booleans)."""
    key = np.zeros(len(cols[0]), dtype=np.int64)
    span = 1  # key < span
    for col in cols:
        radix = int(col.max()) + 1 if len(col) else 1
        if span * radix >= 1 << 62:  # renumber the rows so far before the key could overflow
            key = np.unique(key, return_inverse=True)[1].astype(np.int64)
            span = int(key.max()) + 1
        key, span = key * radix + col, span * radix
    uniq, inv = np.unique(key, return_inverse=True)
    one = np.empty(len(uniq), dtype=np.int64)
    one[inv] = np.arange(len(key))  # any member will do: the row's figures are the same
    return one, inv


def subgroup(one: np.ndarray, inv: np.ndarray, i: np.ndarray, mask: np.ndarray) -> tuple:
    """``group`` restricted to the plans ``i`` (those of ``mask``), for groups that lie wholly
    inside ``mask``: (positions in ``i`` of one plan per group, each plan's group there)."""
    inside = mask[one]
    pos = np.cumsum(inside) - 1
    local = np.empty(len(mask), dtype=np.int64)
    local[i] = np.arange(len(i))
    return local[one[inside]], pos[inv[i]]


def layer_params_split(
    model: ModelSpec, layers: Any, tp: Any, etp: Any, ep: Any
) -> tuple[Any, Any]:
    """(parameters split over TP, routed-expert parameters) of ``layers`` layers on one GPU, for
    one plan or over arrays of plans.

    Attention, norms, dense FFNs, shared experts and the router are split over tp only (they are
    replicated across the expert-parallel ranks); routed experts over etp x ep (Megatron-Core's
    parallel folding; its theoretical memory since PR 4687)."""
    one = not isinstance(layers, np.ndarray)
    if not model.is_moe:
        return layers * params_per_layer(model) / tp, 0.0 if one else np.zeros(len(layers))
    share = layers * model.num_moe_layers / model.num_layers
    moe_layers = round(share) if one else np.round(share).astype(np.int64)
    dense_layers = layers - moe_layers
    dense = dense_layers * params_per_layer(model) / tp
    routed = expert_params_per_layer(model)
    dense_moe = dense + moe_layers * (params_per_layer(model, moe=True) - routed) / tp
    experts = moe_layers * routed / (etp * ep)
    has = moe_layers > 0
    return where(has, dense_moe, dense), where(has, experts, 0.0)
