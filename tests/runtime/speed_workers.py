"""Multi-process workers for the speed-feature tests (test_speed.py): real gloo processes
(mp.spawn), the trainer's own model builder, no mocks."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from aihpc.runspec import TrainingSpec
from aihpc.runtime import TokenLoader, init_distributed
from aihpc.runtime.distributed import DistContext, free_port
from aihpc.runtime.job import build_optimizer
from aihpc.runtime.mesh import Parallel, ParallelDims
from aihpc.runtime.model import LlamaConfig
from aihpc.runtime.parallelize import build_parallel_model

CFG = LlamaConfig(
    dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64, vocab_size=256, max_seq_len=16
)
GLOBAL_BATCH = 4


def train_losses(ctx: DistContext, steps: int, param_dtype: str) -> dict[str, Any]:
    """FSDP2 (ZeRO 3 over every rank; one rank: plain fp32) with ``param_dtype``; the global
    batch's mean loss per step, what each block's FSDP2 unit gathers (dtype of the all-gather
    inputs), the dtype its linears compute with, and the dtype of the reduced gradients."""
    torch.manual_seed(0)
    dims = ParallelDims(dp_shard=ctx.world_size, zero_stage=3)
    t = TrainingSpec(train_steps=20, warmup_steps=2, learning_rate=3e-3, param_dtype=param_dtype)
    model = build_parallel_model(
        CFG, ctx, Parallel(dims, ctx.device.type), 0, "none", training=t
    ).model
    opt, sched = build_optimizer(model, t)
    tokens = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1))
    loader = TokenLoader(tokens, CFG.max_seq_len, GLOBAL_BATCH, seed=0)
    seen: set[str] = set()
    model.layers["0"].attention.wq.register_forward_pre_hook(
        lambda m, args: seen.add(str(m.weight.dtype))
    )
    losses = []
    for _ in range(steps):
        x, y = loader.next_rows(ctx.rank, ctx.world_size)
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        grads = sorted({str(p.grad.dtype) for p in model.parameters()})
        opt.step()
        sched.step()
        opt.zero_grad()
        total = loss.detach() / ctx.world_size
        dist.all_reduce(total)
        losses.append(total.item())
    gathered = []
    for block in model.layers.values():
        state = block._get_fsdp_state() if hasattr(block, "_get_fsdp_state") else None
        group = state._fsdp_param_group if state is not None else None
        for fp in group.fsdp_params if group is not None else []:
            gathered += [str(t.dtype) for t in fp.all_gather_inputs]
    return {
        "losses": losses,
        "gathered": sorted(set(gathered)),
        "compute": sorted(seen),
        "grads": grads,
    }


FUNCS = {"train_losses": train_losses}


def _entry(rank: int, world: int, port: int, name: str, out: str, kwargs: dict) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    with init_distributed(timeout_s=60) as ctx:
        result = FUNCS[name](ctx, **kwargs)
        dist.barrier()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def spawn(world: int, name: str, out: Path, **kwargs: Any) -> list[dict[str, Any]]:
    """Run FUNCS[name] on ``world`` fresh processes; their results, by rank."""
    out.mkdir(parents=True, exist_ok=True)
    mp.spawn(_entry, args=(world, free_port(), name, str(out), kwargs), nprocs=world, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
