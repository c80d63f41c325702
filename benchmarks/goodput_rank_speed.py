"""`aihpc search --rank-by goodput` against the default ranking, side by side in one process:
the search ranked by tokens/s/GPU, by goodput over the arrays of plans (throughput x ETTR of each
plan's step time, what the command runs), and by goodput from every fitting plan's own estimate
(how it ranked before issue 34), on the README's search example and on Llama 3 405B at 16,384
GPUs. CPU seconds of this process, best of N; the three rankings' top plans are compared.

    python benchmarks/goodput_rank_speed.py --results benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as the CLI sets it for the planner

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import add_results_arg  # noqa: E402

SPECS = {
    "README search example (Llama 3 70B, 1,024 H100)": ROOT / "examples" / "llama3-70b-search.toml",
    "Llama 3 405B, 16,384 H100, batch 2,048": {
        "model": {"preset": "llama3-405b"},
        "cluster": {"gpu": "h100-sxm", "num_gpus": 16384, "gpus_per_node": 8},
        "parallel": {"global_batch_size": 2048},
    },
}


def cpu_best(fn, repeats: int) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    best, result = float("inf"), None
    for _ in range(repeats):
        c0 = time.process_time()
        result = fn()
        best = min(best, time.process_time() - c0)
    return best, result


def measure(spec: object, repeats: int) -> dict:
    from aihpc.goodput.ettr import ettr_of_step_time
    from aihpc.perf.search.ranking import search

    ettr_at = ettr_of_step_time(spec)

    def per_estimate(e: object) -> float:
        return e.tokens_per_s_per_gpu * ettr_at(e.step_time_s)  # type: ignore[attr-defined]

    runs = {
        "throughput": lambda: search(spec, top=10),
        "goodput over the arrays": lambda: search(spec, top=10, weight=ettr_at),
        "goodput from each estimate": lambda: search(spec, top=10, key=per_estimate),
    }
    search(spec, top=10)  # warm: lazy imports and caches are not the ranking's
    out = {}
    for name, run in runs.items():
        cpu_s, result = cpu_best(run, repeats)
        out[name] = {
            "cpu_s": cpu_s,
            "feasible": result.feasible,
            "top": [str(e.plan) for e in result.plans],
        }
    base = out["throughput"]["cpu_s"]
    for row in out.values():
        row["x_throughput"] = row["cpu_s"] / base
    same = out["goodput over the arrays"]["top"] == out["goodput from each estimate"]["top"]
    return {"rankings": out, "goodput_top10_identical": same}


def render(res: dict) -> str:
    lines = [
        "# `--rank-by goodput` against the default ranking",
        "",
        f"Produced by `{res['command']}` on {res['date']} (Python {res['python']}, "
        f"load average {res['loadavg_before']} before, {res['loadavg_after']} after); CPU "
        f"seconds of the search, best of {res['repeats']}, all three in one process.",
        "",
        "| spec | ranking | CPU s | × throughput ranking |",
        "|---|---|---:|---:|",
    ]
    for name, r in res["specs"].items():
        for how, row in r["rankings"].items():
            lines.append(f"| {name} | {how} | {row['cpu_s']:.3f} | {row['x_throughput']:.2f} |")
    lines.append("")
    for name, r in res["specs"].items():
        same = "identical" if r["goodput_top10_identical"] else "DIFFERENT"
        lines.append(f"- {name}: the two goodput rankings' top 10 are {same}.")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    add_results_arg(ap)
    args = ap.parse_args()
    from aihpc.runspec import load_runspec, runspec_from_dict

    before = [round(x, 2) for x in os.getloadavg()]
    specs = {
        name: measure(
            load_runspec(s) if isinstance(s, Path) else runspec_from_dict(s), args.repeats
        )
        for name, s in SPECS.items()
    }
    res = {
        "command": " ".join(["python", "benchmarks/goodput_rank_speed.py", *sys.argv[1:]]),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "loadavg_before": before,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "repeats": args.repeats,
        "specs": specs,
    }
    text = render(res)
    print(text)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "goodput_rank_speed.json").write_text(json.dumps(res, indent=2) + "\n")
    (args.results / "goodput_rank_speed.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
