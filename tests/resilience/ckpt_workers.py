"""Multi-process helpers for the checkpoint tests: real processes (mp.spawn), gloo, no mocks.

The state is built exactly as the trainer builds it (model, AdamW + schedule, data cursor, RNG),
so these tests check the runtime's real state, not a toy.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from aihpc.resilience import CheckpointManager, ModelOptimizerState, RNGState, state_sha256
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


def make_state(ctx: DistContext, zero_stage: int = 3) -> dict[str, Any]:
    torch.manual_seed(0)
    dims = ParallelDims(dp_shard=ctx.world_size, zero_stage=zero_stage)
    if zero_stage == 0:
        dims = ParallelDims(dp_replicate=ctx.world_size, zero_stage=0)
    model = build_parallel_model(CFG, ctx, Parallel(dims, ctx.device.type), seed=0).model
    opt, sched = build_optimizer(model, TrainingSpec(train_steps=20, warmup_steps=2))
    tokens = torch.randint(
        0, 256, (4096,), generator=torch.Generator().manual_seed(1), dtype=torch.int64
    ).to(torch.uint8)
    loader = TokenLoader(tokens, CFG.max_seq_len, GLOBAL_BATCH, seed=0)
    return {
        "train": ModelOptimizerState(model, opt),
        "sched": sched,
        "data": loader,
        "rng": RNGState(),
        "_model": model,
        "_opt": opt,
    }


def stateful(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if not k.startswith("_")}


def train(ctx: DistContext, state: dict[str, Any], steps: int) -> None:
    model, opt, sched, loader = state["_model"], state["_opt"], state["sched"], state["data"]
    for _ in range(steps):
        for x, y in loader.next_batch(ctx.rank, ctx.world_size, GLOBAL_BATCH // ctx.world_size):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        torch.rand(3)  # consume the global RNG so its state matters


# ---- worker functions (run on every rank) --------------------------------------------------


def save_after_train(
    ctx: DistContext, root: str, steps: int, async_save: bool, zero_stage: int = 3
) -> dict[str, Any]:
    state = make_state(ctx, zero_stage)
    train(ctx, state, steps)
    with CheckpointManager(root, async_save=async_save) as mgr:
        mgr.save(steps, stateful(state))
    return {"sha": state_sha256(stateful(state))}


def load_and_hash(ctx: DistContext, root: str, zero_stage: int = 3) -> dict[str, Any]:
    state = make_state(ctx, zero_stage)
    fresh = state_sha256(stateful(state))
    with CheckpointManager(root) as mgr:
        step = mgr.load_latest(stateful(state))
    sha = state_sha256(stateful(state))
    train(ctx, state, 1)  # the loaded state must also train
    return {"step": step, "sha": sha, "fresh_sha": fresh, "cursor": state["data"].cursor}


def async_isolation(ctx: DistContext, root: str) -> dict[str, Any]:
    """Mutate everything right after an async save returns; the saved bytes must not change."""
    state = make_state(ctx)
    train(ctx, state, 2)
    before = state_sha256(stateful(state))
    with CheckpointManager(root, async_save=True) as mgr:
        mgr.save(2, stateful(state))
        with torch.no_grad():
            for p in state["_model"].parameters():
                p.add_(1.0)  # in place: the very storage the snapshot was taken from
            for per_param in state["_opt"].state.values():
                for v in per_param.values():
                    v.add_(1.0)  # exp_avg, exp_avg_sq and the scalar step tensor
        state["sched"].step()
        state["data"].cursor += 7
        torch.rand(5)
        mutated = state_sha256(stateful(state))
        mgr.wait()
    fresh = make_state(ctx)
    with CheckpointManager(root) as mgr:
        mgr.load_latest(stateful(fresh))
    return {"before": before, "mutated": mutated, "loaded": state_sha256(stateful(fresh))}


FUNCS = {f.__name__: f for f in (save_after_train, load_and_hash, async_isolation)}


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
    for f in out.glob("rank*.json"):
        f.unlink()
    mp.spawn(_entry, args=(world, free_port(), name, str(out), kwargs), nprocs=world, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def train_and_dump(ctx: DistContext, out_file: str, steps: int) -> dict[str, Any]:
    """Train DDP and FSDP2 in fp32; rank 0 writes the full parameters for comparison."""
    dumps = {}
    for zero_stage in (0, 3):
        dumps[zero_stage] = _train_and_collect(ctx, steps, zero_stage)
    if ctx.rank == 0:
        torch.save(dumps, out_file)
    return {}


def _train_and_collect(ctx: DistContext, steps: int, zero_stage: int) -> dict[str, Any]:
    state = make_state(ctx, zero_stage)

    def full() -> dict[str, torch.Tensor]:
        out = {}
        for name, p in state["_model"].named_parameters():
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name.removeprefix("module.")] = t.detach().clone()
        return out

    init = full()
    train(ctx, state, steps)
    return {"init": init, "final": full()}


FUNCS["train_and_dump"] = train_and_dump
