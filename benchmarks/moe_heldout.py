"""The held-out MoE rows (issue 37) priced by the model, row by row.

    python benchmarks/moe_heldout.py --name moe_heldout_before --results benchmarks/results

Reads ``src/aihpc/perf/fit/data/validation/moe_heldout_runs.csv`` (published MoE runs from
sources the model was not developed on: Megatron-MoE-ModelZoo's Qwen3-235B table, torchtitan's
DeepEP README), prices each row with its published plan as ``aihpc validate`` does, and writes
predicted vs measured tokens/s/GPU and, where published, the peak memory. A row the model
refuses is listed with its one-line reason, not dropped.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import add_results_arg, machine, save

from aihpc.perf.fit.runs_csv import RUNS_COLUMNS, cell, read_table
from aihpc.perf.fit.validate import data_file, predict_row
from aihpc.perf.step.memory import GiB
from aihpc.runspec.errors import SpecError


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", default="moe_heldout")
    ap.add_argument("--csv", type=Path, default=data_file("moe_heldout_runs.csv"))
    add_results_arg(ap)
    args = ap.parse_args()
    rows, lines = [], []
    for row in read_table(args.csv, RUNS_COLUMNS, "runs CSV"):
        try:
            r = predict_row(row)
        except SpecError as err:
            rows.append({"id": row["id"], "refused": str(err)})
            lines.append(f"| {row['id']} | {cell(row, 'model')} | refused: {err} | | | |")
            continue
        mem = r.estimate.memory.total / GiB
        rows.append(
            {
                "id": r.id,
                "model": r.model,
                "num_gpus": r.num_gpus,
                "measured_tokens_per_s_per_gpu": r.measured,
                "predicted_tokens_per_s_per_gpu": r.predicted,
                "error": r.error,
                "measured_memory_gib": r.measured_memory_gib,
                "predicted_memory_gib": mem,
            }
        )
        mm = (
            f"{r.measured_memory_gib:.1f} / {mem:.1f}"
            if r.measured_memory_gib
            else f"– / {mem:.1f}"
        )
        lines.append(
            f"| {r.id} | {r.model} | {r.num_gpus} | {r.measured:,.0f} | {r.predicted:,.0f} "
            f"| {r.error:+.1%} | {mm} |"
        )
    priced = [abs(r["error"]) for r in rows if "error" in r]
    summary = {
        "priced": len(priced),
        "refused": len(rows) - len(priced),
        "mape": statistics.fmean(priced) if priced else None,
        "max_abs_error": max(priced) if priced else None,
    }
    md = "\n".join(
        [
            "| id | model | GPUs | measured tok/s/GPU | predicted | error "
            "| memory GiB (measured / predicted) |",
            "|---|---|---:|---:|---:|---:|---:|",
            *lines,
            "",
            f"priced {summary['priced']}, refused {summary['refused']}; "
            + (
                f"MAPE {summary['mape']:.1%}, worst {summary['max_abs_error']:.1%}"
                if priced
                else "nothing priced"
            ),
        ]
    )
    save(args.name, {"machine": machine(), "rows": rows, "summary": summary}, md, args.results)


if __name__ == "__main__":
    main()
