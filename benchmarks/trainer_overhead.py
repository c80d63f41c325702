"""The trainer's step time against a minimal hand-written PyTorch loop on the same model.

    python benchmarks/trainer_overhead.py [--rounds 3] [--steps 40]

Both run in their own process, one rank, one thread, fp32 (the trainer's CPU choice), the
same model
(preset tiny-llama-small: 4 layers, dim 256, seq 128), batch 8, AdamW, grad clipping. The
trainer is ``aihpc train`` itself (ZeRO 0, so no FSDP wrapper at world 1; no checkpoint until
the last step, which is excluded); the loop is ~20 lines. Rounds alternate the two, so both
see the same machine load. Per-step wall time between consecutive step ends, median over
steps after the first 5, then the median over rounds. Target: ratio <= 1.05.
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
num_gpus = 1
gpus_per_node = 1
[parallel]
zero_stage = 0
micro_batch_size = 8
global_batch_size = 8
[training]
train_steps = {steps}
warmup_steps = 5
log_interval = 1000
[checkpoint]
interval_steps = 100000
"""
WARMUP = 5


def minimal_loop(steps: int) -> list[float]:
    """The hand-written reference: model, AdamW + warmup/cosine, clip, step."""
    import math

    import torch
    import torch.nn.functional as F

    from aihpc.runtime import LlamaConfig, load_tokens
    from aihpc.runtime.model import Llama
    from aihpc.spec import load_runspec

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


def median_step(ends: list[float]) -> float:
    return statistics.median(
        b - a for a, b in zip(ends[WARMUP:-1], ends[WARMUP + 1 : -1], strict=False)
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--minimal", action="store_true", help=argparse.SUPPRESS)
    from _common import add_results_arg, machine, save

    add_results_arg(ap)
    args = ap.parse_args()
    if args.minimal:
        print(json.dumps(minimal_loop(args.steps)))
        return

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    per = {"trainer": [], "minimal": []}
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "run.toml"
        spec.write_text(SPEC.format(steps=args.steps))
        env["BENCH_SPEC"] = str(spec)
        for r in range(args.rounds):
            run = Path(tmp) / f"run{r}"
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "aihpc",
                    "train",
                    str(spec),
                    "--run-dir",
                    str(run),
                    "--json",
                ],
                check=True,
                env=env,
                capture_output=True,
            )
            rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            per["trainer"].append(median_step([x["end_unix"] for x in rows]))
            out = subprocess.run(
                [sys.executable, __file__, "--minimal", "--steps", str(args.steps)],
                check=True,
                env=env,
                capture_output=True,
                text=True,
            ).stdout
            per["minimal"].append(median_step(json.loads(out)))
    med = {k: statistics.median(v) for k, v in per.items()}
    ratio = med["trainer"] / med["minimal"]
    md = (
        "# Trainer step-time overhead vs a minimal PyTorch loop\n\n"
        f"tiny-llama-small (4 layers, dim 256, seq 128), batch 8, fp32, 1 rank, "
        f"1 thread; {args.rounds} alternating rounds of {args.steps} steps.\n\n"
        "| loop | median step (ms) | per round (ms) |\n|---|---:|---|\n"
        + "\n".join(
            f"| {k} | {med[k] * 1e3:.1f} | " + ", ".join(f"{x * 1e3:.1f}" for x in per[k]) + " |"
            for k in per
        )
        + f"\n\n**trainer / minimal = {ratio:.3f}** (target <= 1.05)."
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
