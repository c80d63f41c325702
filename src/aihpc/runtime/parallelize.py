"""Apply a plan to the single-device model, in torchtitan's order: FP8 linears → pipeline split →
tensor parallel → context parallel → (activation checkpointing, inside each layer) →
``torch.compile`` of each block → data parallel (DDP / FSDP2 / HSDP, with its mixed-precision
policy) → allocate (``to_empty``) → ``init_weights``. The speed features are speed.py's. One
function per parallelism (``apply_tp`` in tp.py, the stages in pp.py, ``apply_cp`` and
``apply_dp`` here); the model is built on the ``meta`` device, so nothing is allocated before it
is sharded.

Data parallel, by ZeRO stage (the planner's terms):

- 0: parameters and optimizer states replicated. DDP for a data-parallel-only plan; with any
  model parallelism FSDP2 over a mesh whose shard dimension has size 1 (replicas only), since
  DDP does not take DTensor parameters.
- 1 and 2: FSDP2 with ``reshard_after_forward=False`` (parameters stay gathered between forward
  and backward, the closest FSDP2 has to ZeRO-1/2).
- 3: FSDP2 full shard. HSDP when ``dp_shard`` < dp: shard inside the group, replicate across.

Expert parallel (``ep`` > 1, MoE models): ``apply_ep`` shards each MoE block's experts over the
EP sub-mesh first; data parallel then wraps each block's experts in their own FSDP2 unit over the
expert-data-parallel sub-mesh (replicas under ZeRO 0, shards under 1-3), so expert gradients are
averaged over the ranks holding the same experts and every other gradient over all of dp x cp.
DDP cannot hold EP-sharded weights (it would broadcast rank 0's experts), so ZeRO 0 with EP is
FSDP2 with a size-1 shard dimension, as under model parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from aihpc.comm import EPGroups
from aihpc.runspec import TrainingSpec
from aihpc.runtime.distributed import DistContext
from aihpc.runtime.expert_parallel import apply_ep
from aihpc.runtime.mesh import Parallel
from aihpc.runtime.model import Llama, LlamaConfig
from aihpc.runtime.moe import MoE
from aihpc.runtime.pp import StageModule, stage_ids, stage_layers
from aihpc.runtime.speed import apply_fp8, compile_blocks, ddp_comm_hook, mp_policy
from aihpc.runtime.tp import apply_tp

__all__ = ["ModelParts", "apply_cp", "apply_dp", "build_parallel_model", "unwrap"]


@dataclass
class ModelParts:
    """The rank's model (every parameter it holds: what the optimizer steps and checkpoints
    save) and, under pipeline parallel, its stages in schedule order."""

    model: nn.Module
    stages: list[StageModule] = field(default_factory=list)
    stage_ids: list[int] = field(default_factory=list)
    num_stages: int = 1

    @property
    def first(self) -> bool:
        """Holds the embedding: feeds tokens to the pipeline."""
        return not self.stages or 0 in self.stage_ids

    @property
    def last(self) -> bool:
        """Holds the output: computes the loss."""
        return not self.stages or self.num_stages - 1 in self.stage_ids


def _prune_for_stages(model: Llama, par: Parallel) -> ModelParts:
    """Keep only the layers (and embedding / head) of this rank's pipeline stages."""
    dims = par.dims
    ids = stage_ids(dims, par.pp_rank)
    n = dims.pp * (2 if dims.pp_schedule == "zbv" else dims.vpp)
    split = stage_layers(model.cfg.num_layers, n)
    owned = {str(i) for s in ids for i in split[s]}
    for key in [k for k in model.layers if k not in owned]:
        del model.layers[key]
    if 0 not in ids:
        model.tok_embeddings = None
    if n - 1 not in ids:
        model.norm = model.output = None
    stages = [StageModule(model, split[s], s == 0, s == n - 1) for s in ids]
    return ModelParts(model, stages, ids, n)


def apply_cp(model: Llama, par: Parallel) -> None:
    """Context parallel: this rank sees the load-balanced half-chunks r and 2cp - 1 - r of the
    sequence, and attention runs as a ring over the CP group (aihpc.comm.ring)."""
    from aihpc.comm.ring import load_balanced_layout

    model.set_layout(load_balanced_layout(model.cfg.max_seq_len, par.dims.cp), par.cp_rank)
    for block in model.layers.values():
        block.attention.cp_group = par.cp_group


def apply_dp(parts: ModelParts, par: Parallel, policy: Any = None) -> None:
    """FSDP2 (ZeRO 1-3, HSDP, or replicas for ZeRO 0 under model parallelism): each layer, then
    each pipeline stage (or the whole model) as the root of what is left (embedding, head).
    ``policy``: FSDP2's MixedPrecisionPolicy (speed.mp_policy), None for fp32 throughout."""
    mesh = par.fsdp_mesh()
    if mesh.size() == 1:
        return  # one data-parallel rank: nothing to shard or replicate
    reshard = par.dims.zero_stage == 3
    kw = {"reshard_after_forward": reshard} | ({"mp_policy": policy} if policy else {})
    for block in parts.model.layers.values():
        if par.ep_mesh is not None and isinstance(block.feed_forward, MoE):
            experts = block.feed_forward.experts
            fully_shard(experts, mesh=par.expert_fsdp_mesh(), **kw)
        fully_shard(block, mesh=mesh, **kw)
    for root in parts.stages or [parts.model]:
        fully_shard(root, mesh=mesh, **kw)


def build_parallel_model(
    cfg: LlamaConfig,
    ctx: DistContext,
    par: Parallel,
    seed: int,
    recompute: str = "none",
    recompute_modules: tuple[str, ...] = (),
    training: TrainingSpec | None = None,
) -> ModelParts:
    """The rank's part of the model, initialised from ``seed`` (the same values under any
    plan), parallelised as ``par`` says, its layers recomputing as ``recompute`` and
    ``recompute_modules`` say, with ``training``'s speed features (FP8, compile, FSDP2's mixed
    precision; none when None)."""
    t = training or TrainingSpec()
    with torch.device("meta"):
        model = Llama(cfg, recompute, recompute_modules)
    if t.precision == "fp8":
        apply_fp8(model, gather_fp8=t.fp8_param_gather)
    dims = par.dims
    parts = _prune_for_stages(model, par) if dims.pp > 1 else ModelParts(model)
    if dims.cp > 1:
        apply_cp(model, par)
    if dims.tp > 1:
        apply_tp(model, par.tp_mesh, dims.sequence_parallel, par.ep_mesh is not None, dims.etp)
    if par.ep_mesh is not None:
        apply_ep(model, EPGroups(par.ep_mesh.get_group()), mesh=par.ep_mesh)
    if t.compile:
        compile_blocks(model)
    if dims.pure_data_parallel and dims.zero_stage == 0 and par.ep_mesh is None:
        model.to_empty(device=ctx.device)
        model.init_weights(seed)
        if ctx.world_size > 1:
            ids = [ctx.device.index] if ctx.device.type == "cuda" else None
            parts.model = DistributedDataParallel(model, device_ids=ids)
            hook = ddp_comm_hook(t)
            if hook is not None:
                parts.model.register_comm_hook(None, hook)
        return parts
    apply_dp(parts, par, mp_policy(t, ctx.device.type))
    model.to_empty(device=ctx.device)
    model.init_weights(seed)
    return parts


def unwrap(model: nn.Module) -> Any:
    return model.module if isinstance(model, DistributedDataParallel) else model
