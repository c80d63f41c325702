"""Recovery strategies side by side for docs/goodput.md §8 and docs/resilience.md: ETTR of
storage-only, async, in-memory peer and in-process restart at 16K and 100K GPUs, in the
scenarios that decide which one wins, each checked by the event simulator.

    python benchmarks/strategy_table.py                         # ./benchmark-results/
    python benchmarks/strategy_table.py --results DIR           # DIR/strategy_table.{md,json}
    ... --measured benchmarks/results/recovery_time.json         # adds the measured-relaunch row
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

from _common import add_results_arg, machine, save  # benchmarks/, this script's folder

from aihpc.goodput.ettr import GoodputParams
from aihpc.goodput.failures import components
from aihpc.goodput.simulator import simulate
from aihpc.goodput.strategies import STRATEGIES, compare_strategies, measured_figures
from aihpc.runspec import load_runspec

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "llama3-405b-16k.toml"
SOFTWARE = {"software", "nccl_watchdog"}


def _storage(spec, read_GBps: float, write_GBps: float | None = None):  # type: ignore[no-untyped-def]
    cl = replace(
        spec.cluster, storage_read_bw_GBps=read_GBps, storage_write_bw_GBps=write_GBps or read_GBps
    )
    return replace(spec, cluster=cl)


def _rel(spec, **fields):  # type: ignore[no-untyped-def]
    return replace(spec, reliability=replace(spec.reliability, **fields))


def scenarios(spec, measured: Path | None):  # type: ignore[no-untyped-def]
    """(name, spec, keyword arguments of compare_strategies)."""
    soft3 = {name: 3 * c.rate_per_unit_hour for name, c in components().items() if name in SOFTWARE}
    yield "published defaults (2 TB/s storage, 10 min relaunch)", spec, {}
    yield "storage 200 GB/s", _storage(spec, 200.0), {}
    yield "storage reads at 20 GB/s (restore 4.7 min)", _storage(spec, 20.0, 2000.0), {}
    yield (
        "as above, every node loss takes its peer",
        _storage(spec, 20.0, 2000.0),
        {"correlated_loss_fraction": 1.0},
    )
    yield "software failures x3", _rel(spec, failure_rates=soft3), {}
    yield "hot spares: relaunch 60 s", _rel(spec, restart_time_s=60.0), {}
    if measured is not None:
        facts = measured_figures(json.loads(measured.read_text()), measured.name)
        yield "measured relaunch (2 ranks, CPU; mixes sources)", spec, {"measured": facts}


def sim_ettr(res) -> float:  # type: ignore[no-untyped-def]
    mix = res.recoveries(res.interval_s)
    lam = sum(r for r, _ in mix)
    p = GoodputParams(
        1 / lam, res.blocking_s, res.persist_s, math.nan, res.planned_rate_per_s, res.planned_cost_s
    )
    return simulate(
        p, res.interval_s, num_failures=20_000, seed=res.num_gpus, recovery_mix=mix
    ).ettr


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_results_arg(ap)
    ap.add_argument(
        "--measured",
        type=Path,
        metavar="FILE",
        help="recovery_time.json of benchmarks/recovery_time.py: adds a row with measured figures",
    )
    args = ap.parse_args()
    if args.measured is not None and not args.measured.is_file():
        ap.error(f"--measured {args.measured}: no such file")
    spec = load_runspec(EXAMPLE)
    head = "| scenario | GPUs | " + " | ".join(STRATEGIES.values()) + " | best |"
    lines = [head, "|" + "---|" * (3 + len(STRATEGIES))]
    data, worst = [], 0.0
    for name, s, kw in scenarios(spec, args.measured):
        for n, row in compare_strategies(s, (16384, 100000), **kw).items():
            cells = []
            for res in row.values():
                sim = sim_ettr(res)
                worst = max(worst, abs(sim - res.ettr))
                cells.append(f"{res.ettr:.1%} ({sim:.1%})")
                d = res.to_json()
                keep = ("strategy", "num_gpus", "ettr", "checkpoint_interval_s", "mean_recovery_s")
                row_json = {k: d[k] for k in keep} | {"lost_time_fraction": d["lost_time_fraction"]}
                data.append({"scenario": name, **row_json, "ettr_sim": sim})
            best = max(row.values(), key=lambda r: r.ettr)
            lines.append(
                f"| {name} | {n:,} | " + " | ".join(cells) + f" | {STRATEGIES[best.strategy]} |"
            )
    text = "\n".join(
        [
            "ETTR at each strategy's optimal interval, `examples/llama3-405b-16k.toml` (5.68 TB "
            "checkpoints), Llama 3 failure mix; in brackets the discrete-event simulation "
            f"(20,000 failures, recovery drawn per failure); largest difference {worst:.2%}.",
            "",
            *lines,
        ]
    )
    save("strategy_table", {"machine": machine(), "rows": data}, text, args.results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
