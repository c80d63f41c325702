"""GRPO on the shipped addition task: held-out exact-answer accuracy before and after RL.

    python benchmarks/grpo_tiny.py --results benchmarks/results

For each seed: the tiny Llama (examples/rl/grpo_tiny_cpu.toml: 2 layers, width 64, byte
vocabulary) is first trained supervised on the task's format (``--sft-steps``), then runs
``train_steps`` GRPO steps (``aihpc rl train``'s loop, aihpc.runtime.rl.run). Accuracy is greedy
exact match on the seed's held-out problems (a quarter of the 400 pairs, never trained on),
measured on the rollout model after the warm-up and after the last step.

    python benchmarks/grpo_tiny.py --placement disaggregated --rollout-workers 2 --staleness 1

runs the same with rollout in worker processes of their own, weights broadcast to them over a
gloo group and each batch generated from weights up to ``--staleness`` updates old (results
``grpo_tiny_disaggregated_s1``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import add_results_arg, machine, save

from aihpc.runspec import load_runspec, runspec_from_dict
from aihpc.runtime.rl.run import RunOptions, run_rl

SPEC = Path(__file__).parents[1] / "examples" / "rl" / "grpo_tiny_cpu.toml"


def _shown(path: Path) -> str:
    """The spec's path as the results record it: relative to the repository when inside it
    (a machine's own paths stay out of committed results)."""
    try:
        return str(path.resolve().relative_to(Path(__file__).parents[1].resolve()))
    except ValueError:
        return path.name


def one_seed(spec_path: Path, seed: int, sft_steps: int, pool: tuple[int, int] | None) -> dict:
    import tomllib

    raw = tomllib.loads(spec_path.read_text())
    raw["training"]["seed"] = seed
    if pool is not None:  # (rollout workers, staleness)
        raw["rl"] |= {"placement": "disaggregated", "rollout_gpus": pool[0], "staleness": pool[1]}
        raw["cluster"] |= {"num_gpus": pool[0] + 1, "gpus_per_node": pool[0] + 1}
    spec = runspec_from_dict(raw)
    with tempfile.TemporaryDirectory() as run_dir:
        t0 = time.perf_counter()
        summary = run_rl(spec, Path(run_dir), RunOptions(sft_steps=sft_steps))
        rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    wall = time.perf_counter() - t0
    tenth = max(1, len(rows) // 10)
    return {
        "seed": seed,
        "accuracy_sft": summary["accuracy_before"],
        "accuracy_grpo": summary["accuracy_after"],
        "heldout_prompts": summary["heldout_prompts"],
        "grpo_steps": summary["steps"],
        "reward_first_tenth": statistics.mean(r["reward"] for r in rows[:tenth]),
        "reward_last_tenth": statistics.mean(r["reward"] for r in rows[-tenth:]),
        "kl_last": rows[-1]["kl"],
        "staleness_max": max(r.get("staleness", 0) for r in rows),
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", type=Path, default=SPEC)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--sft-steps", type=int, default=400)
    ap.add_argument("--placement", choices=["colocated", "disaggregated"], default="colocated")
    ap.add_argument("--rollout-workers", type=int, default=2)
    ap.add_argument("--staleness", type=int, default=0)
    add_results_arg(ap)
    args = ap.parse_args()
    load_runspec(args.spec)  # its own rules first
    pool, name = None, "grpo_tiny"
    if args.placement == "disaggregated":
        pool = (args.rollout_workers, args.staleness)
        name = f"grpo_tiny_disaggregated_s{args.staleness}"
    runs = [one_seed(args.spec, s, args.sft_steps, pool) for s in args.seeds]
    before = statistics.mean(r["accuracy_sft"] for r in runs)
    after = statistics.mean(r["accuracy_grpo"] for r in runs)
    lines = [
        "# GRPO on the addition task (tiny Llama, CPU)",
        "",
        f"`{' '.join(sys.argv)}`; spec `{args.spec.name}`, {args.sft_steps} supervised steps, "
        f"then GRPO ({args.placement}"
        + (f", {pool[0]} rollout workers, staleness {pool[1]}" if pool else "")
        + "); greedy exact-answer accuracy on held-out problems.",
        "",
        "| seed | held-out | after SFT | after GRPO | GRPO steps | reward first / last tenth "
        "| KL last | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['seed']} | {r['heldout_prompts']} | {r['accuracy_sft']:.3f} | "
            f"{r['accuracy_grpo']:.3f} | {r['grpo_steps']} | {r['reward_first_tenth']:.3f} / "
            f"{r['reward_last_tenth']:.3f} | {r['kl_last']:.4f} | {r['wall_s']:.0f} |"
        )
    lines += ["", f"Mean accuracy {before:.3f} -> {after:.3f} over {len(runs)} seeds."]
    data = {"machine": machine(), "spec": _shown(args.spec), "sft_steps": args.sft_steps,
            "placement": args.placement, "rollout_workers": pool[0] if pool else 0,
            "staleness": pool[1] if pool else 0,
            "runs": runs, "mean_before": before, "mean_after": after}  # fmt: skip
    save(name, data, "\n".join(lines) + "\n", args.results)


if __name__ == "__main__":
    main()
