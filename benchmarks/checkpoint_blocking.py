"""Async vs sync checkpoint save: how long training is blocked, measured side by side.

    python benchmarks/checkpoint_blocking.py [--repeats 5] [--dim 512] [--layers 8]

One process, torch.distributed initialised (world of 1, gloo), a Llama model + AdamW state
(the trainer's state: model, optimizer, schedule, data cursor, RNG). Sync and async saves
alternate so both see the same machine load; blocking time is what ``save()`` costs the
training loop, commit time is until the checkpoint is committed (manifest + rename).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
import torch.nn.functional as F
from _common import add_results_arg, machine, save

from aihpc.resilience import CheckpointManager, ModelOptimizerState, RNGState
from aihpc.runspec import TrainingSpec
from aihpc.runtime import init_distributed
from aihpc.runtime.job import build_optimizer
from aihpc.runtime.mesh import Parallel, ParallelDims
from aihpc.runtime.model import LlamaConfig
from aihpc.runtime.parallelize import build_parallel_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    add_results_arg(ap)
    args = ap.parse_args()
    cfg = LlamaConfig(
        dim=args.dim,
        num_layers=args.layers,
        num_heads=8,
        num_kv_heads=4,
        ffn_dim=args.dim * 11 // 4,
        vocab_size=256,
        max_seq_len=64,
    )
    with init_distributed(timeout_s=300) as ctx, tempfile.TemporaryDirectory() as tmp:
        dims = ParallelDims(dp_shard=ctx.world_size, zero_stage=3)
        model = build_parallel_model(cfg, ctx, Parallel(dims, ctx.device.type), seed=0).model
        opt, sched = build_optimizer(model, TrainingSpec())
        x = torch.randint(0, 256, (2, 64))
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        opt.step()  # creates the Adam moments, so the state is full size
        state = {"train": ModelOptimizerState(model, opt), "sched": sched, "rng": RNGState()}
        nbytes = sum(p.numel() * 4 * 3 for p in model.parameters())
        rows = {"sync": [], "async": []}
        managers = {
            m: CheckpointManager(Path(tmp) / m, keep_last=2, async_save=(m == "async"))
            for m in rows
        }
        step = 0
        for _ in range(args.repeats + 1):  # first round warms up (allocations, plan caches)
            for mode, mgr in managers.items():
                step += 1
                t0 = time.perf_counter()
                mgr.save(step, state)
                blocking = time.perf_counter() - t0
                mgr.wait()
                committed = time.perf_counter() - t0
                rows[mode].append((blocking, committed))
        for mgr in managers.values():
            mgr.close()
    med = {
        m: (statistics.median(b for b, _ in r[1:]), statistics.median(c for _, c in r[1:]))
        for m, r in rows.items()
    }
    ratio = med["async"][0] / med["sync"][0]
    data = {
        "machine": machine(),
        "model": cfg.__dict__,
        "state_MiB": nbytes / 2**20,
        "repeats": args.repeats,
        "runs_s": rows,
        "median_blocking_s": {m: v[0] for m, v in med.items()},
        "median_committed_s": {m: v[1] for m, v in med.items()},
        "async_over_sync_blocking": ratio,
    }
    md = (
        f"# Checkpoint save: async vs sync blocking time\n\n"
        f"State: Llama dim {args.dim}, {args.layers} layers, params + AdamW moments "
        f"= {nbytes / 2**20:.0f} MiB; {args.repeats} alternating saves each after one warm-up.\n\n"
        "| mode | blocking (median) | until committed (median) |\n|---|---:|---:|\n"
        f"| sync | {med['sync'][0] * 1e3:.1f} ms | {med['sync'][1] * 1e3:.1f} ms |\n"
        f"| async | {med['async'][0] * 1e3:.1f} ms | {med['async'][1] * 1e3:.1f} ms |\n\n"
        f"**Async blocking / sync blocking = {ratio:.3f}** (training is blocked for "
        f"{ratio * 100:.1f} % of a synchronous save)."
    )
    save("checkpoint_blocking", data, md, results=args.results)


if __name__ == "__main__":
    main()
