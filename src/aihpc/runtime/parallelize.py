"""Apply data parallelism to a single-device model: DDP (ZeRO 0) or FSDP2 ``fully_shard``.

Order (torchtitan's): build on ``meta`` → shard → ``to_empty`` → ``init_weights``. DDP needs
real parameters at wrap time (it broadcasts them), so it is applied after initialisation.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from aihpc.runtime.distributed import DistContext
from aihpc.runtime.model import Llama, LlamaConfig

__all__ = ["build_parallel_model", "unwrap"]


def build_parallel_model(
    cfg: LlamaConfig, ctx: DistContext, zero_stage: int, seed: int, recompute: str = "none"
) -> nn.Module:
    """The model, initialised from ``seed`` and parallelised over ``ctx.mesh``, its layers
    recomputing activations as ``recompute`` says (none | selective | op | full).

    zero_stage 0: DDP (replicated parameters and optimizer state). 1 and 2: FSDP2 with
    ``reshard_after_forward=False`` (parameters stay gathered between forward and backward, the
    closest FSDP2 has to ZeRO-1/2). 3: FSDP2 full shard.
    """
    with torch.device("meta"):
        model = Llama(cfg, recompute)
    if zero_stage == 0:
        model.to_empty(device=ctx.device)
        model.init_weights(seed)
        if ctx.world_size == 1:
            return model
        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    reshard = zero_stage == 3
    for block in model.layers:
        fully_shard(block, mesh=ctx.mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=ctx.mesh, reshard_after_forward=reshard)
    model.to_empty(device=ctx.device)
    model.init_weights(seed)
    return model


def unwrap(model: nn.Module) -> Llama:
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    assert isinstance(inner, Llama)
    return inner
