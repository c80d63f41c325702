"""Timing overhead of `aihpc bench comm` against a bare torch.distributed loop, side by side.

For each size, in one process group, alternately (``--reps`` rounds, so drifting machine load hits
both alike):
  bare: ``dist.all_reduce(t)`` ``iters`` times between a barrier and a wall-clock read, averaged
        over ranks exactly as the benchmark does;
  aihpc: ``run_comm_bench`` on the same collective, size and iteration count (its in-place
        column is the same single-buffer all_reduce; correctness check off, since it runs after
        the timed loop anyway and is not timed).
The ratio aihpc / bare (median over rounds) should be close to 1: the harness adds a barrier and a
Python loop around the same calls and nothing per iteration.

    python benchmarks/bench_comm_overhead.py                # 2 gloo processes on CPU
    python benchmarks/bench_comm_overhead.py --nproc 1      # one rank: isolates per-call cost
    python benchmarks/bench_comm_overhead.py --nproc 4 --sizes 1K,64K,4M

Results go to benchmarks/results/comm_overhead_<N>proc.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist

from aihpc.bench.collectives import parse_size
from aihpc.bench.comm import CommConfig, run_comm_bench
from aihpc.bench.dist import init_distributed, launch_local

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_results_arg


def _bare_us(ctx, size: int, iters: int, warmup: int) -> float:
    t = torch.ones(size // 4, dtype=torch.float32, device=ctx.device)
    for _ in range(warmup):
        dist.all_reduce(t)
    ctx.sync()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    ctx.sync()
    dt = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(dt)
    return float(dt.item()) / ctx.world_size * 1e6


def worker(sizes: list[int], iters: int, warmup: int, reps: int) -> dict:
    with init_distributed(300.0) as ctx:
        rows = []
        for size in sizes:
            bare, ours, ours_oop = [], [], []
            cfg = CommConfig(("all_reduce",), (size,), iters, warmup, check=False)
            for _ in range(reps):
                bare.append(_bare_us(ctx, size, iters, warmup))
                (r,) = run_comm_bench(ctx, cfg)
                ours.append(r.in_place.time_us)
                ours_oop.append(r.out_of_place.time_us)
            ratios = [o / b for o, b in zip(ours, bare, strict=True)]
            rows.append(
                {
                    "size_bytes": size,
                    "bare_us_median": statistics.median(bare),
                    "aihpc_in_place_us_median": statistics.median(ours),
                    "aihpc_out_of_place_us_median": statistics.median(ours_oop),
                    "ratio_median": statistics.median(ratios),
                    "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                }
            )
        return {"backend": ctx.backend, "world_size": ctx.world_size, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--sizes", default="1K,64K,1M,8M")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=11)
    add_results_arg(ap)
    args = ap.parse_args()
    sizes = [parse_size(s, "--sizes") for s in args.sizes.split(",")]
    t0 = time.time()
    out = launch_local(args.nproc, worker, sizes, args.iters, args.warmup, args.reps)
    command = "python " + " ".join(["benchmarks/bench_comm_overhead.py", *sys.argv[1:]])
    meta = {
        "command": command,
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "iters": args.iters,
        "warmup": args.warmup,
        "reps": args.reps,
        "wall_s": round(time.time() - t0, 1),
    }
    doc = {**meta, **out}
    lines = [
        f"all_reduce, {out['backend']}, {out['world_size']} processes, {args.iters} iterations, "
        f"median of {args.reps} alternating rounds",
        "",
        "| size (B) | bare loop (us) | aihpc in-place (us) | ratio (median, min-max) "
        "| aihpc out-of-place (us) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in out["rows"]:
        lines.append(
            f"| {r['size_bytes']} | {r['bare_us_median']:.1f} | "
            f"{r['aihpc_in_place_us_median']:.1f} | {r['ratio_median']:.3f} "
            f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) | "
            f"{r['aihpc_out_of_place_us_median']:.1f} |"
        )
    md = "\n".join(lines)
    args.results.mkdir(parents=True, exist_ok=True)
    name = f"comm_overhead_{args.nproc}proc"
    (args.results / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    (args.results / f"{name}.md").write_text(
        f"Produced by `{command}` on {meta['date_utc']} (torch {meta['torch']}, "
        f"{meta['cpus']} CPUs, load average after the run {meta['load_avg_after']}, "
        f"{meta['wall_s']} s).\n\n{md}\n\n"
        "The out-of-place column includes the copy into a fresh output buffer that PyTorch's "
        "in-place-only all_reduce needs; compare the in-place column with the bare loop.\n"
    )
    print(md)


if __name__ == "__main__":
    main()
