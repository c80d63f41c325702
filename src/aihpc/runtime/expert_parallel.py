"""Expert parallelism for the MoE blocks of a single-device model, and what training with it needs.

``apply_ep(model, groups)`` gives every ``MoE`` block our dispatch / combine operators over the
EP group (``aihpc.comm``) and keeps only this rank's experts: the expert weights become DTensors
``Shard(0)`` on the EP mesh (torchtitan's layout), so ``Llama.init_weights`` draws the full tensor
from its per-name seed and keeps this rank's slice (initial weights independent of EP), and a DCP
checkpoint stores each expert once, reshardable to another EP size. Everything else (attention,
router, shared experts, norms) stays replicated.

Gradients. Each rank's loss is over its own tokens; the experts on a rank see tokens of every
rank of its EP group, so their local gradient is the *sum* over the EP group of the per-rank loss
gradients. ``apply_ep`` scales it by 1 / ep inside the graph, making it the EP group's mean:
then averaging expert gradients over the expert-data-parallel group (the ranks holding the same
experts) and replicated gradients over all data-parallel ranks gives exactly the gradient of the
mean loss over the global batch, with any averaging DP wrapper (DDP / FSDP with their default
mean) or with ``allreduce_gradients`` below. Without the scale, expert gradients come out ep
times too large (the single-process reference tests catch it).

Apply order (torchtitan's ``parallelize_llama``): build on meta → ``apply_ep`` → data parallel
→ ``to_empty`` → ``init_weights``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from aihpc.comm import EPGroups, MoEDispatcher
from aihpc.runspec import SpecError
from aihpc.runtime.moe import MoE

__all__ = ["allreduce_gradients", "apply_ep", "clip_grad_norm_", "expert_parameters"]


def _shard_experts(block: MoE, groups: EPGroups, mesh: DeviceMesh) -> None:
    ep, rank = groups.size, groups.rank
    experts = block.experts
    for name in ("w1", "w3", "w2"):
        full = getattr(experts, name)
        per_rank = full.shape[0] // ep
        local = full.detach()[rank * per_rank : (rank + 1) * per_rank].clone()
        sharded = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
        )
        setattr(experts, name, nn.Parameter(sharded, requires_grad=full.requires_grad))
    experts.grad_scale = 1.0 / ep


def apply_ep(model: nn.Module, groups: EPGroups, mesh: DeviceMesh | None = None) -> nn.Module:
    """Shard the experts of every MoE block over ``groups`` (in place; returns ``model``).

    The block's current expert weights (real or meta) are sliced, so a model initialised before
    ``apply_ep`` keeps its values. ``groups`` with ``ranks_per_node`` set and intra / inter
    groups use the hierarchical dispatch. ``mesh``: the 1-D EP mesh of ``groups.group`` as a
    sub-mesh of the job's device mesh (the trainer's; FSDP2 then shards the experts over the
    expert-data-parallel sub-mesh of the same root); None: a mesh made from the group.
    """
    blocks = [m for m in model.modules() if isinstance(m, MoE)]
    if not blocks:
        return model
    ep = groups.size
    num_experts = blocks[0].cfg.num_experts
    if num_experts % ep:
        raise SpecError("parallel.ep", ep, f"must divide model.num_experts {num_experts}")
    if mesh is None and ep > 1:
        mesh = DeviceMesh.from_group(groups.group, groups.device_type)
    for block in blocks:
        block.dispatcher = MoEDispatcher(block.cfg.num_experts, groups)
        if mesh is not None:
            _shard_experts(block, groups, mesh)
    return model


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters sharded by expert parallelism (DTensors on an EP mesh)."""
    return [p for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters()]


def _average(grads: list[torch.Tensor], group: Any) -> None:
    """Average gradients over ``group`` with one all-reduce (flattened, then copied back)."""
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


@torch.no_grad()
def allreduce_gradients(
    model: nn.Module, dp_group: Any = None, expert_dp_group: Any = None
) -> None:
    """Plain data parallelism for an EP model, after backward: replicated gradients averaged
    over ``dp_group`` (None: every rank), expert gradients over ``expert_dp_group``.

    For wrappers that cannot hold EP-sharded weights (DDP would broadcast rank 0's experts to
    every rank); FSDP / HSDP over the expert-data-parallel mesh does the same job.
    """
    experts = {id(p) for p in expert_parameters(model)}
    replicated, sharded = [], []
    for p in model.parameters():
        if p.grad is None:
            continue
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        (sharded if id(p) in experts else replicated).append(g)
    _average(replicated, dp_group)
    if expert_dp_group is not None:
        _average(sharded, expert_dp_group)


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model mixing plain and DTensor gradients (it
    refuses the mix): the total 2-norm is the root of the sum of each kind's squared norm, a
    DTensor's norm being over its whole mesh (every expert counted once)."""
    groups: dict[Any, list[nn.Parameter]] = {}
    for p in model.parameters():
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    squares = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares.append(norm.to(torch.promote_types(norm.dtype, torch.float32)) ** 2)
    if not squares:
        return torch.zeros(())
    total = torch.stack([s.to(squares[0].dtype) for s in squares]).sum().sqrt()
    for params in groups.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
