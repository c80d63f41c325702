"""`aihpc calibrate --runs` on a split of the published rows: fit the efficiency multipliers on one
cluster's rows, check them on every other row, for each cluster of the shared set in turn.

    python benchmarks/calibrate_split.py                 # prints it, writes ./benchmark-results/
    python benchmarks/calibrate_split.py --results DIR   # DIR/calibrate_split.{md,json}

A cluster is one source's rows (the five groups `aihpc validate` reports a MAPE for: Narayanan
et al. and Korthikanti et al. on NVIDIA's Selene A100s, Megatron-Core's and NeMo's H100 tables,
torchtitan's power-capped H100s). Per cluster: the MAPE of its rows at the default constants,
fitted, and leave-one-out; then the MAPE of the other rows at the default constants and with
the fitted multipliers.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
import time
from pathlib import Path

from _common import add_results_arg  # benchmarks/, this script's folder

from aihpc.perf.fit.runs_fit import fit_runs, load_runs
from aihpc.perf.fit.validate import data_file, source_key

COMMAND = " ".join(["python", "benchmarks/calibrate_split.py", *sys.argv[1:]])


def _write(path: Path, rows: list[dict[str, str]], columns: list[str]) -> Path:
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


def split_table(tmp: Path) -> tuple[list[dict], str]:
    with open(data_file("published_runs.csv"), newline="") as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
        columns = list(reader.fieldnames or [])
    clusters: dict[str, list[dict[str, str]]] = {}
    for row in rows:
        clusters.setdefault(source_key(row["source"]), []).append(row)
    out, lines = (
        [],
        [
            "| fitted on | runs | multipliers (gemm, attention, scale_up, scale_out) | "
            "MAPE default | fitted | leave-one-out | other rows: default | calibrated |",
            "|---|---:|---|---:|---:|---:|---:|---:|",
        ],
    )
    for name, group in clusters.items():
        t0 = time.perf_counter()
        fit = fit_runs(load_runs(_write(tmp / "fit.csv", group, columns)))
        others = [r for r in rows if r not in group]
        checked = fit.check(load_runs(_write(tmp / "check.csv", others, columns)))
        scales = ", ".join(
            f"{v:.3f}" + ("" if k in fit.names else " (-)") + ("!" if k in fit.at_bound else "")
            for k, v in fit.scales.items()
        )
        lines.append(
            f"| {name} | {len(group)} | {scales} | {fit.default_mape:.1%} | "
            f"{fit.fitted_mape:.1%} | {fit.loo_mape:.1%} | {checked['default_mape']:.1%} | "
            f"{checked['calibrated_mape']:.1%} |"
        )
        out.append(
            {
                "cluster": name,
                **fit.to_json(),
                "check": checked,
                "elapsed_s": time.perf_counter() - t0,
            }
        )
    lines += [
        "",
        "(-): not exercised by the cluster's runs, left at 1; !: ended on its bound.",
    ]
    return out, "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_results_arg(ap)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data, table = split_table(Path(tmp))
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "calibrate_split.json").write_text(
        json.dumps({"command": COMMAND, "clusters": data}, indent=2) + "\n"
    )
    (args.results / "calibrate_split.md").write_text(f"Produced by `{COMMAND}`.\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
