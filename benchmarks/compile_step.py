"""One GPU: the trainer's step with ``training.compile`` off and on, and the host's issue of one
decoder layer, eager and compiled, each beside the model's price.

    python benchmarks/compile_step.py [--results DIR] [--steps N]     # skips without a GPU

1. Host issue (perf/step/host_issue.py). One dense decoder layer of the trainer
   (runtime/model.py's Block, bf16 autocast) at a shape whose kernels take microseconds
   (micro-batch 1, 128 tokens, width 256), so the GPU waits on the host: forward, and forward +
   backward, issued ``--iters`` times back to back with one synchronize at the end; the host's
   time per pass is the wall time over the passes. Eager and compiled (``Block.compile``), each
   against ``issue_host_s``'s price for the same layer.
2. Trainer step. ``aihpc train`` on this GPU for a small model (tiny-llama-small, micro-batch 1
   and 4: host-bound, as the issue's H200 runs at micro-batch 1 were), compile off and on: the
   summary's median step time after the first against ``aihpc estimate``'s for the same spec as
   the trainer runs it (runtime/summary.py's ``as_trained``: eager kernels, or compiled).

Writes compile_step.json/.md. Without a CUDA GPU it prints one line saying it skipped and exits
0 (gpu_checks.sh step 10 relies on that).
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
from typing import Any

from _common import add_results_arg, catalog_gpu, machine, save

SPEC = """
[model]
preset = "tiny-llama-small"
seq_length = 512
[cluster]
gpu = "{gpu}"
num_gpus = 1
[parallel]
micro_batch_size = {mbs}
global_batch_size = {gbs}
[training]
train_steps = {steps}
warmup_steps = 2
compile = {compile}
[checkpoint]
interval_steps = 1000
async_save = false
"""


def _time_passes(run: Any, iters: int) -> float:
    """Seconds per call of ``run`` issued ``iters`` times, one synchronize at the end."""
    import torch

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def host_issue(iters: int) -> list[dict[str, Any]]:
    """Measured forward and backward host time of one layer, eager and compiled, beside
    ``issue_host_s``."""
    import dataclasses

    import torch

    from aihpc.perf.step.host_issue import issue_host_s
    from aihpc.perf.step.params import DEFAULT_PARAMS
    from aihpc.runspec import TrainingSpec
    from aihpc.runtime.config import LlamaConfig
    from aihpc.runtime.model import Block, rope_tables

    cfg = LlamaConfig(
        dim=256, num_layers=1, num_heads=4, num_kv_heads=2, ffn_dim=688, vocab_size=256,
        max_seq_len=128,
    )  # fmt: skip
    dev = torch.device("cuda")
    cos, sin = rope_tables(128, cfg.head_dim, 10000.0, device=dev)
    rope = (cos, sin, torch.arange(128, device=dev)[None])
    rows = []
    for compiled in (False, True):
        block = Block(cfg).to(dev)
        if compiled:
            block.compile(backend="inductor")
        x = torch.randn(1, 128, 256, device=dev, requires_grad=True)

        def fwd(block: Any = block, x: Any = x) -> Any:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return block(x, rope)

        def fwd_bwd(fwd: Any = fwd) -> None:
            fwd().float().sum().backward()

        t_f = _time_passes(fwd, iters)  # the forward alone (its graph dropped unused)
        t_fb = _time_passes(fwd_bwd, iters)
        training = dataclasses.replace(TrainingSpec(), fused_kernels=compiled, compile=compiled)
        p_f, p_b = issue_host_s(training, DEFAULT_PARAMS)
        rows.append(
            {
                "layer": "compiled" if compiled else "eager",
                "measured_fwd_ms": 1e3 * t_f,
                "measured_fwd_bwd_ms": 1e3 * t_fb,
                "priced_fwd_ms": 1e3 * p_f,
                "priced_fwd_bwd_ms": 1e3 * (p_f + p_b),
                "error_fwd_bwd": (p_f + p_b) / t_fb - 1,
            }
        )
    return rows


def trainer_steps(gpu: str, steps: int, out: Path) -> list[dict[str, Any]]:
    """``aihpc train`` compile off and on at micro-batch 1 and 4: measured against predicted."""
    rows = []
    for mbs in (1, 4):
        for compiled in (False, True):
            tag = f"mbs{mbs}_{'compiled' if compiled else 'eager'}"
            spec = out / f"{tag}.toml"
            text = SPEC.format(
                gpu=gpu, mbs=mbs, gbs=4 * mbs, steps=steps, compile=str(compiled).lower()
            )
            spec.write_text(text)
            proc = subprocess.run(
                [sys.executable, "-m", "aihpc", "train", str(spec), "--run-dir",
                 str(out / tag), "--json"],
                capture_output=True, text=True, timeout=600, env={**os.environ},
            )  # fmt: skip
            if proc.returncode:
                rows.append({"run": tag, "error": proc.stderr.strip().splitlines()[-1:]})
                continue
            perf = json.loads(proc.stdout)["performance"]
            rows.append(
                {
                    "run": tag,
                    "measured_step_ms": 1e3 * perf["measured_step_time_s"],
                    "predicted_step_ms": 1e3 * (perf["predicted_step_time_s"] or float("nan")),
                    "step_time_error": perf["step_time_error"],
                }
            )
    return rows


def _markdown(issue: list[dict], steps: list[dict]) -> str:
    lines = [
        "| layer | fwd measured ms | fwd priced ms | fwd+bwd measured ms | fwd+bwd priced ms |",
        "|---|---|---|---|---|",
    ]
    for r in issue:
        lines.append(
            f"| {r['layer']} | {r['measured_fwd_ms']:.3f} | {r['priced_fwd_ms']:.3f} | "
            f"{r['measured_fwd_bwd_ms']:.3f} | {r['priced_fwd_bwd_ms']:.3f} |"
        )
    lines += [
        "",
        "| trainer run | measured step ms | predicted step ms | error |",
        "|---|---|---|---|",
    ]
    for r in steps:
        if "error" in r:
            lines.append(f"| {r['run']} | failed: {r['error']} | | |")
            continue
        err = r["step_time_error"]
        lines.append(
            f"| {r['run']} | {r['measured_step_ms']:.1f} | {r['predicted_step_ms']:.1f} | "
            f"{'-' if err is None else f'{err:+.0%}'} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_results_arg(ap)
    ap.add_argument("--steps", type=int, default=20, help="Trainer steps per run.")
    ap.add_argument("--iters", type=int, default=50, help="Layer passes timed.")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("compile_step.py: skipped, no CUDA GPU visible")
        return
    gpu = catalog_gpu()
    issue = host_issue(args.iters)
    with tempfile.TemporaryDirectory() as tmp:
        steps = trainer_steps(gpu, args.steps, Path(tmp))
    median = statistics.median(abs(r["error_fwd_bwd"]) for r in issue)
    data = {"machine": machine(), "gpu": gpu, "host_issue": issue, "trainer": steps}
    data["host_issue_median_abs_error"] = median
    save("compile_step", data, _markdown(issue, steps), args.results)


if __name__ == "__main__":
    main()
