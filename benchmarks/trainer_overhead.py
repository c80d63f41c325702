"""The trainer's step time against a minimal hand-written PyTorch loop on the same model and plan.

    python benchmarks/trainer_overhead.py [--rounds 3] [--steps 40] [--plans 1rank,tp2,pp2]

Both run in their own processes, fp32 (the trainer's CPU choice), one thread per rank, the same
model (preset tiny-llama-small: 4 layers, dim 256, seq 128), global batch 8, AdamW, grad
clipping. The trainer is ``aihpc train`` itself (no checkpoint until the last step, which is
excluded); the minimal loop is the same plan written directly against the PyTorch APIs the
trainer uses, with the model parallelised by the same calls (``build_parallel_model``: DTensor
``parallelize_module`` for tp2 with sequence parallel, ``torch.distributed.pipelining``'s
Schedule1F1B for pp2), a random batch, ``loss_parallel`` under tp, the pipeline's gradient norm
all-reduced over the stages, AdamW, no data loader, watchdog, metrics or events. Plans:

- ``1rank``: one process (ZeRO 0, no wrapper);
- ``tp2``: tensor + sequence parallel over 2 processes;
- ``pp2``: 2 pipeline stages, 1F1B, 2 micro-batches of 4.

Rounds alternate the two, so both see the same machine load. Per-step wall time between
consecutive step ends on rank 0, median over steps after the first 5, then the median over
rounds. Target: ratio <= 1.05.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

SPEC = """
[model]
preset = "tiny-llama-small"
[cluster]
gpu = "h100-sxm"
num_gpus = {ranks}
gpus_per_node = {ranks}
[parallel]
{parallel}
zero_stage = 0
micro_batch_size = {micro}
global_batch_size = 8
[training]
train_steps = {steps}
warmup_steps = 5
log_interval = 1000
[checkpoint]
interval_steps = 100000
"""
# name: (ranks, [parallel] lines, micro-batch size)
PLANS = {
    "1rank": (1, "", 8),
    "tp2": (2, "tp = 2\nsequence_parallel = true", 8),
    "pp2": (2, 'pp = 2\npp_schedule = "1f1b"', 4),
}
WARMUP = 5


def minimal_loop(steps: int) -> list[float]:
    """The hand-written reference: model, AdamW + warmup/cosine, clip, step."""
    import math

    import torch
    import torch.nn.functional as F

    from aihpc.runspec import load_runspec
    from aihpc.runtime import LlamaConfig, load_tokens
    from aihpc.runtime.model import Llama

    spec = load_runspec(os.environ["BENCH_SPEC"])
    t = spec.training
    torch.manual_seed(t.seed)
    model = Llama(LlamaConfig.from_spec(spec.model))
    model.init_weights(t.seed)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=t.learning_rate,
        weight_decay=t.weight_decay,
        betas=(t.adam_beta1, t.adam_beta2),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1, (s + 1) / t.warmup_steps) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    tokens = load_tokens().to(torch.int64)
    seq = spec.model.seq_length
    ends = []
    for _ in range(steps):
        idx = torch.randint(0, len(tokens) - seq - 1, (8,))
        batch = torch.stack([tokens[i : i + seq + 1] for i in idx])
        logits = model(batch[:, :-1])  # fp32 on the CPU, as the trainer does
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        ends.append(time.time())
    return ends


def minimal_parallel_loop(steps: int) -> list[float]:
    """The same under torchrun for tp2 / pp2: the model parallelised by the trainer's calls into
    DTensor / pipelining, then a bare loop on a random batch."""
    from contextlib import nullcontext

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel

    from aihpc.runspec import load_runspec
    from aihpc.runtime import LlamaConfig
    from aihpc.runtime.distributed import init_distributed
    from aihpc.runtime.mesh import Parallel, ParallelDims
    from aihpc.runtime.parallelize import build_parallel_model
    from aihpc.runtime.pp import build_schedule

    spec = load_runspec(os.environ["BENCH_SPEC"])
    t, plan = spec.training, spec.plan()
    ends: list[float] = []
    with init_distributed() as ctx:
        par = Parallel(ParallelDims.from_plan(plan, ctx.world_size), "cpu")
        torch.manual_seed(t.seed)
        parts = build_parallel_model(LlamaConfig.from_spec(spec.model), ctx, par, t.seed)
        params = [p for p in parts.model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=t.weight_decay)

        def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.flatten(0, 1), y.flatten())

        pipe = par.dims.pp > 1
        micro = plan.micro_batch_size
        if pipe:
            n = plan.global_batch_size // micro
            sched = build_schedule(
                parts.stages, parts.stage_ids, par.dims, par.pp_group, ctx.device, n, loss_fn
            )
        seq, vocab = spec.model.seq_length, spec.model.vocab_size
        for _ in range(steps):
            batch = torch.randint(0, vocab, (plan.global_batch_size, seq + 1))
            x, y = batch[:, :-1], batch[:, 1:]
            if pipe:
                losses: list[torch.Tensor] = []
                args = (x,) if parts.first else ()
                sched.step(*args, target=y if parts.last else None, losses=losses)
                sq = torch.nn.utils.get_total_norm([p.grad for p in params]) ** 2
                dist.all_reduce(sq, group=par.pp_group)  # the norm over all stages
                torch.nn.utils.clip_grads_with_norm_(params, t.grad_clip, sq.sqrt())
            else:
                ctx_tp = loss_parallel() if par.dims.tp > 1 else nullcontext()
                with ctx_tp:
                    loss = loss_fn(parts.model(x), y)
                    loss.backward()
                torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            ends.append(time.time())
    return ends


def median_step(ends: list[float]) -> float:
    return statistics.median(
        b - a for a, b in zip(ends[WARMUP:-1], ends[WARMUP + 1 : -1], strict=False)
    )


def _train_round(spec: Path, run: Path, ranks: int, env: dict[str, str]) -> float:
    cmd = [sys.executable, "-m", "aihpc", "train", str(spec), "--run-dir", str(run), "--json"]
    if ranks > 1:
        cmd += ["--nproc-per-node", str(ranks)]
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return median_step([x["end_unix"] for x in rows])


def _minimal_round(plan: str, ranks: int, steps: int, out: Path, env: dict[str, str]) -> float:
    me = [__file__, "--minimal", plan, "--steps", str(steps), "--out", str(out)]
    if ranks == 1:
        cmd = [sys.executable, *me]
    else:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(ranks), *me,
        ]  # fmt: skip
    subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
    return median_step(json.loads(out.read_text()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--plans", default=",".join(PLANS), help="comma list of " + ", ".join(PLANS))
    ap.add_argument("--minimal", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    from _common import add_results_arg, machine, save

    add_results_arg(ap)
    args = ap.parse_args()
    if args.minimal:
        ends = (
            minimal_loop(args.steps)
            if args.minimal == "1rank"
            else (minimal_parallel_loop(args.steps))
        )
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.out).write_text(json.dumps(ends))
        return
    plans = [p for p in args.plans.split(",") if p]
    for name in plans:
        if name not in PLANS:
            raise SystemExit(f"--plans: {name!r} is not one of {', '.join(PLANS)}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    per: dict[str, dict[str, list[float]]] = {p: {"trainer": [], "minimal": []} for p in plans}
    with tempfile.TemporaryDirectory() as tmp:
        for name in plans:
            ranks, parallel, micro = PLANS[name]
            spec = Path(tmp) / f"{name}.toml"
            spec.write_text(
                SPEC.format(steps=args.steps, ranks=ranks, parallel=parallel, micro=micro)
            )
            env["BENCH_SPEC"] = str(spec)
            for r in range(args.rounds):
                run = Path(tmp) / f"{name}-run{r}"
                per[name]["trainer"].append(_train_round(spec, run, ranks, env))
                out = Path(tmp) / f"{name}-min{r}.json"
                per[name]["minimal"].append(_minimal_round(name, ranks, args.steps, out, env))
                print(
                    f"{name} round {r + 1}: trainer {per[name]['trainer'][-1] * 1e3:.1f} ms, "
                    f"minimal {per[name]['minimal'][-1] * 1e3:.1f} ms",
                    flush=True,
                )
    med = {p: {k: statistics.median(v) for k, v in d.items()} for p, d in per.items()}
    ratio = {p: m["trainer"] / m["minimal"] for p, m in med.items()}
    rows = []
    for p in plans:
        for k in ("trainer", "minimal"):
            runs = ", ".join(f"{x * 1e3:.1f}" for x in per[p][k])
            rows.append(f"| {p} | {k} | {med[p][k] * 1e3:.1f} | {runs} |")
    md = (
        "# Trainer step-time overhead vs a minimal PyTorch loop\n\n"
        "tiny-llama-small (4 layers, dim 256, seq 128), global batch 8, fp32, 1 thread per "
        f"rank; {args.rounds} alternating rounds of {args.steps} steps per plan.\n\n"
        "| plan | loop | median step (ms) | per round (ms) |\n|---|---|---:|---|\n"
        + "\n".join(rows)
        + "\n\n"
        + "; ".join(f"**{p}: trainer / minimal = {ratio[p]:.3f}**" for p in plans)
        + " (target <= 1.05)."
    )
    save(
        "trainer_overhead",
        {
            "machine": machine(),
            "rounds": args.rounds,
            "steps": args.steps,
            "median_step_s": med,
            "per_round_s": per,
            "ratio": ratio,
        },
        md,
        results=args.results,
    )


if __name__ == "__main__":
    main()
