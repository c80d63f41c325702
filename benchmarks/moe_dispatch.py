"""MoE dispatch / combine, our operators against a plain all_to_all_single dispatcher, side by side.

Runs `aihpc bench moe`'s measurement (aihpc.bench.moe: DeepEP's setting, per-rank GB/s, every
call checked element by element) ``--reps`` times in one process group, alternating, so that
drifting machine load hits every implementation alike, and reports medians over the rounds:
time per dispatch and per combine, DeepEP's GB/s (token bytes a rank receives / time), the bytes
that cross nodes, and our time over the plain dispatcher's.

    python benchmarks/moe_dispatch.py                                  # 2 gloo ranks, one node
    python benchmarks/moe_dispatch.py --nproc 4 --ranks-per-node 2     # 2 emulated nodes
    python benchmarks/moe_dispatch.py --nproc 8 --tokens 4096 --hidden 7168 --experts 256 \\
        --tag h100x8                                                   # one 8-GPU node (NCCL)

Results: RESULTS/moe_dispatch_<tag>.{json,md} (``--results DIR``; the published ones are in
benchmarks/results); the JSON also holds the medians as
``all_to_all`` calibration points, so `aihpc calibrate` reads it like a `bench moe --json` file.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from _common import add_results_arg, machine, save

from aihpc.bench.dist import init_distributed, launch_local
from aihpc.bench.moe import MoEBenchConfig, MoEResult, Phase, calibration_points, run_moe_bench


def rounds(cfg: MoEBenchConfig, reps: int) -> list[list[MoEResult]]:
    with init_distributed(600.0) as ctx:
        return [run_moe_bench(ctx, cfg) for _ in range(reps)]


def _median(results: list[MoEResult]) -> tuple[MoEResult, dict[str, float]]:
    """The round-median result, and the spread (min, max) of each phase's time."""
    first = results[0]
    med = {}
    spread = {}
    for phase in ("dispatch", "combine"):
        times = [getattr(r, phase).time_us for r in results]
        t = statistics.median(times)
        med[phase] = Phase(t, first.recv_bytes / 1e3 / t, first.xnode_bytes / 1e3 / t)
        spread[phase] = (min(times), max(times))
    wrong = sum(r.wrong or 0 for r in results)
    return dataclasses.replace(first, wrong=wrong, **med), spread


def _table(meds: list[tuple[MoEResult, dict]], nproc: int, rpn: int) -> str:
    base = {r.tokens: r for r, _ in meds if r.impl == "a2a_single"}
    lines = [
        "| tokens/rank | impl | recv (KiB) | cross-node (KiB) | dispatch (us) | GB/s | "
        "combine (us) | GB/s | dispatch / plain | combine / plain | #wrong |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r, spread in meds:
        b = base.get(r.tokens)
        ratio_d = f"{r.dispatch.time_us / b.dispatch.time_us:.2f}" if b else "-"
        ratio_c = f"{r.combine.time_us / b.combine.time_us:.2f}" if b else "-"
        d_lo, d_hi = spread["dispatch"]
        c_lo, c_hi = spread["combine"]
        lines.append(
            f"| {r.tokens} | {r.impl} | {r.recv_bytes / 1024:.0f} | {r.xnode_bytes / 1024:.0f} | "
            f"{r.dispatch.time_us:.0f} ({d_lo:.0f}-{d_hi:.0f}) | {r.dispatch.GBps:.3f} | "
            f"{r.combine.time_us:.0f} ({c_lo:.0f}-{c_hi:.0f}) | {r.combine.GBps:.3f} | "
            f"{ratio_d} | {ratio_c} | {r.wrong} |"
        )
    first = meds[0][0]
    head = (
        f"{nproc} ranks ({nproc // rpn} node(s) of {rpn}), {first.experts} experts, top-"
        f"{first.topk}, node-limited to {first.topk_groups} node(s), hidden {first.hidden}, "
        f"{first.dtype}; medians of the rounds (min-max)"
    )
    return head + "\n\n" + "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    add_results_arg(ap)
    ap.add_argument("--ranks-per-node", type=int, default=None)
    ap.add_argument("--tokens", default="256,1024,4096")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tag", default=None, help="results name (default: cpu_<N>proc)")
    a = ap.parse_args()
    rpn = a.ranks_per_node or a.nproc
    cfg = MoEBenchConfig(
        tokens=tuple(int(t) for t in a.tokens.split(",")),
        hidden=a.hidden,
        topk=a.topk,
        experts=a.experts,
        iters=a.iters,
        warmup=1,
        ranks_per_node=rpn,
    )
    t0 = time.perf_counter()
    reps = launch_local(a.nproc, rounds, cfg, a.reps)
    meds = [_median([rep[i] for rep in reps]) for i in range(len(reps[0]))]
    results = [m for m, _ in meds]
    data = dict(
        benchmark="moe",
        machine={**machine(), "elapsed_s": round(time.perf_counter() - t0, 1)},
        backend="nccl" if torch.cuda.is_available() else "gloo",
        reps=a.reps,
        iters=a.iters,
        results=[r.to_json() for r in results],  # the JSON key `aihpc bench moe --json` uses
        spread_us=[s for _, s in meds],
        calibration=calibration_points(results, "ours_hier" if rpn < a.nproc else "ours"),
    )
    save(
        f"moe_dispatch_{a.tag or f'cpu_{a.nproc}proc'}",
        data,
        _table(meds, a.nproc, rpn),
        a.results,
    )


if __name__ == "__main__":
    main()
