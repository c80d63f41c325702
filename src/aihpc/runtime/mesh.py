"""The parallel degrees of a run and the one device mesh they lay out over the ranks.

Rank order is the planner's (and Megatron's ``tp-cp-ep-dp-pp``): tensor parallel innermost, so a
TP group is consecutive ranks on one node, then context parallel, then data parallel, then
pipeline stages outermost. Data parallel is split in two for FSDP / HSDP: ``dp_replicate``
(replicas, across nodes) and ``dp_shard`` (the ZeRO / FSDP shard group, inside a node).

The mesh has four dimensions, ``pp, fsdp_replicate, fsdp_shard, tp``; FSDP2 takes the middle two
(as one parent mesh with the TP dimension, which FSDP2 needs for tensor-parallel parameters).
Context parallel sits inside ``fsdp_replicate`` (as dp_replicate x cp) when parameters are
replicated (ZeRO 0) and inside ``fsdp_shard`` (as dp_shard x cp) when they are sharded, so
gradients are averaged over dp x cp, which is right: CP ranks hold the same parameters and
different tokens. The CP process group comes from unflattening that dimension.

Expert parallel is folded into the same ranks (Megatron-Core's "parallel folding"): the EP group
is ``ep`` consecutive ranks of the data-parallel dimension that holds context parallel
(``fsdp_replicate`` under ZeRO 0, ``fsdp_shard`` otherwise), unflattened into ``(edp, ep)``;
expert weights are sharded over ``ep`` and replicated (ZeRO 0) or FSDP-sharded (ZeRO 1-3) over
the expert-data-parallel ranks ``edp = dp x cp / ep``, while every other weight keeps the dense
layout over dp x cp. Every sub-mesh comes from the one root mesh, which FSDP2 needs to combine the
EP placement of an expert weight with its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aihpc.runspec import ParallelPlan, SpecError

__all__ = ["PIPELINE_SCHEDULES", "Parallel", "ParallelDims"]

PIPELINE_SCHEDULES = ("1f1b", "interleaved-1f1b", "zbv")
_DIMS = ("pp", "fsdp_replicate", "fsdp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees the runtime lays out; ``from_plan`` checks them against the world size."""

    pp: int = 1
    vpp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    pp_schedule: str = "1f1b"
    ep: int = 1
    etp: int = 1  # expert tensor parallel: 1, or tp (every expert split over the TP ranks)

    @classmethod
    def from_plan(cls, plan: ParallelPlan, world_size: int) -> ParallelDims:
        """The plan's degrees for ``world_size`` processes: dp is the world size over
        tp x pp x cp (the plan's dp, when the run spec gives one, must agree)."""
        mp = plan.tp * plan.pp * plan.cp
        if world_size % mp:
            raise SpecError(
                "parallel", f"tp*pp*cp = {mp}", f"must divide the world size {world_size}"
            )
        dp = world_size // mp
        shard = plan_dp_shard(plan, dp)
        return cls(
            pp=plan.pp,
            vpp=plan.vpp,
            dp_replicate=dp // shard,
            dp_shard=shard,
            cp=plan.cp,
            tp=plan.tp,
            zero_stage=plan.zero_stage,
            sequence_parallel=plan.sequence_parallel,
            pp_schedule=plan_pp_schedule(plan),
            ep=plan.ep,
            etp=plan.etp,
        )

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def cp_r(self) -> int:
        """Context-parallel ranks inside the replicate dimension (ZeRO 0), else 1."""
        return self.cp if self.zero_stage == 0 else 1

    @property
    def cp_s(self) -> int:
        """Context-parallel ranks inside the shard dimension (ZeRO 1-3), else 1."""
        return 1 if self.zero_stage == 0 else self.cp

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate * self.cp_r, self.dp_shard * self.cp_s, self.tp)

    @property
    def ep_dim(self) -> int:
        """The mesh dimension (1 or 2) the EP group is carved out of: the one holding CP."""
        return 1 if self.zero_stage == 0 else 2

    @property
    def pure_data_parallel(self) -> bool:
        return self.pp == self.cp == self.tp == 1


def plan_dp_shard(plan: ParallelPlan, dp: int) -> int:
    """The FSDP shard group of ``plan`` on ``dp`` data-parallel ranks: all of them (FSDP),
    ``plan.dp_shard`` of them (HSDP), or none (ZeRO 0: replicas only)."""
    if plan.zero_stage == 0:
        return 1
    shard = plan.dp_shard or dp
    if dp % shard:
        raise SpecError("parallel.dp_shard", shard, f"must divide the data-parallel degree {dp}")
    return shard


def plan_pp_schedule(plan: ParallelPlan) -> str:
    return plan.schedule


class Parallel:
    """Owns the degrees and the device mesh; passed explicitly (no process-group globals)."""

    def __init__(self, dims: ParallelDims, device_type: str) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.dims = dims
        self.mesh = init_device_mesh(device_type, dims.shape, mesh_dim_names=_DIMS)
        pp, rep, shard, _ = self.mesh.get_coordinate() or [0, 0, 0, 0]
        self.pp_rank = pp
        self.dp_rank = (rep // dims.cp_r) * dims.dp_shard + shard // dims.cp_s
        self.cp_rank = rep % dims.cp_r + shard % dims.cp_s
        self._cp_group: Any = None
        if dims.cp > 1:
            where = "fsdp_replicate" if dims.cp_r > 1 else "fsdp_shard"
            sizes = (dims.dp_replicate, dims.cp) if dims.cp_r > 1 else (dims.dp_shard, dims.cp)
            split = self.mesh._unflatten(where, sizes, ("dp_part", "cp"))
            self._cp_group = split["cp"].get_group()
        self.ep_mesh: Any = None  # 1-D: this rank's expert-parallel group
        self._expert_dp_mesh: Any = None  # FSDP2's mesh for the expert weights
        if dims.ep > 1:
            where = _DIMS[dims.ep_dim]
            size = dims.shape[dims.ep_dim]
            split = self.mesh._unflatten(where, (size // dims.ep, dims.ep), ("edp", "ep"))
            self.ep_mesh = split["ep"]
            if dims.zero_stage == 0:  # replicas over edp, a size-1 shard dimension
                self._expert_dp_mesh = split["edp", "fsdp_shard"]
            elif dims.shape[1] == 1:
                self._expert_dp_mesh = split["edp"]
            else:  # HSDP: replicate across the groups, shard over edp inside
                self._expert_dp_mesh = split["fsdp_replicate", "edp"]
        self._batch_group: Any = None

    @property
    def tp_mesh(self) -> Any:
        return self.mesh["tp"]

    @property
    def cp_group(self) -> Any:
        return self._cp_group

    @property
    def pp_group(self) -> Any:
        return self.mesh["pp"].get_group()

    def batch_group(self) -> Any:
        """The data x context parallel ranks of this stage, whose tokens make up its global batch
        (the routers' load counts are summed over them), and its tensor-parallel ranks, which
        route their own sequence shards under tensor parallel with expert TP 1 (runtime/tp.py;
        with expert TP = tp every TP rank routes the whole sequence). Created on the first call,
        which is collective."""
        if self._batch_group is None:
            dp_dims: tuple[str, ...] = ("fsdp_replicate", "fsdp_shard")
            if self.dims.tp > 1 and self.dims.etp == 1:
                dp_dims += ("tp",)
            self._batch_group = self.mesh[dp_dims]._flatten("batch").get_group()
        return self._batch_group

    def expert_fsdp_mesh(self) -> Any:
        """FSDP2's mesh for expert weights: the expert-data-parallel ranks (ep > 1 only)."""
        return self._expert_dp_mesh

    def fsdp_mesh(self) -> Any:
        """1-D (shard) or 2-D (replicate, shard) mesh for ``fully_shard``."""
        if self.dims.shape[1] == 1:
            return self.mesh["fsdp_shard"]
        return self.mesh["fsdp_replicate", "fsdp_shard"]
