"""The performance model's step time against `aihpc train`'s measured one, plan by plan, on this
host.

    python benchmarks/predicted_vs_measured.py [--steps 8] [--rounds 1] [--results DIR]
    python benchmarks/predicted_vs_measured.py --plans "1 rank" cp2   # only these plans
    python benchmarks/predicted_vs_measured.py --gpu --steps 20   # one-GPU plans, catalog GPU

1. `aihpc calibrate --local --nproc 2` measures this host (GEMMs at one thread per rank, memory
   bandwidth, the model's attention calls at their length and half of it, gloo collectives on
   2 ranks back to back, between computations and beside them, the host time DTensor's
   dispatch adds to one op of the trainer's tensor-parallel decoder and of its optimizer
   step, and what a fresh page costs and the share of a training step's large fresh
   allocations that fault) and writes the calibration and a gpu_spec;
2. every plan below (20 on a CPU: every schedule the trainer runs -- 1F1B, interleaved 1F1B,
   ZBV; it has no GPipe --, ZeRO 0-3, recompute none / selective / full, TP with and without SP,
   CP, EP on a mixture-of-experts variant, torch.compile, and issue 41's eight plans) trains the
   same model (preset tiny-llama-small: 4 layers, dim 256, seq 128; global batch 8) for
   ``--steps`` steps with `aihpc train`, whose summary.json holds `aihpc estimate`'s prediction
   for the same spec on this host, priced with the trainer's own software facts (eager
   element-wise ops and loss, an eager layer's host issue, TP collectives in line, DTensor's
   eager dispatch, the ring's unfused attention, FSDP2's and DDP's copies, the page faults of
   fresh allocations: `as_trained` in runtime/summary.py, perf/step/page_faults.py;
   `performance` in summary.json);
3. per plan: the median step after the first WARMUP steps (the typical step, what a user
   waits for; the fastest is shown too), the prediction, error = predicted / median - 1 and
   its sign (+: pessimistic); over plans: median |error|, the worst, Spearman's rho between
   the predicted and measured orders (targets: <= 10%, >= 0.85), and how many predictions
   fall on each side. ``--rounds R`` trains every plan R times, interleaved (round-robin,
   each round starting further down the table, so no plan always follows a calibration or
   the same neighbour), and a plan's measured step is the median over the rounds of each
   round's median step (one round slowed by other work moves it no more than one value of
   R); on a CPU every round calibrates the host afresh first, and a plan's prediction is the
   median of its rounds' (a calibration's noise goes both ways: a slowed GEMM timing makes
   the host look slower, a slowed baseline makes the overlap penalty, a ratio of two
   timings, look smaller; three calibrations of one morning measured it at 1.0, 0.20 and
   0.94). A plan the trainer refuses is listed under ``failed`` and the others still run.
   Each plan's 1-minute load average (the higher of its start and end, the highest over its
   rounds) is in its row, the whole run's in the results' ``machine``: on the shared 2-core
   host other jobs stretch every step, which no prediction for the machine alone can price.

Every rank runs one thread (OMP_NUM_THREADS=1); the 1-rank plan is priced with a one-rank
calibration, the 2-rank plans with the 2-rank one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import add_results_arg, catalog_gpu, machine, save

from aihpc.runspec.tomlw import dumps_toml

MODEL = """[model]
preset = "tiny-llama-small"
"""
TRAIN = """[training]
precision = "bf16"
train_steps = {steps}
warmup_steps = 2
log_interval = 1000
[checkpoint]
interval_steps = 100000
"""
# One thread per rank everywhere (the launcher's choice for several ranks), so the 1-rank plan
# and its calibration see the same core count as each rank of the others.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# steps not compared: the first (allocations, first-call dispatch caches, gloo's first
# connections) and the second (the allocator and the caches settling)
WARMUP = 2
# A mixture-of-experts variant of the same model (4 experts of FFN 352, top-2: the same active
# FFN width as the dense 704), for the expert-parallel plan and its one-rank baseline.
MOE = """num_experts = 4
moe_top_k = 2
moe_ffn_hidden_size = 352
"""
# name, ranks, [parallel] lines[, extra [model] lines]: every schedule the trainer runs (1F1B,
# interleaved 1F1B, ZBV; it has no GPipe), every ZeRO stage (0 = DDP, 1, 2, 3 = FSDP2),
# recompute none / selective / full, tp with and without sequence parallel, CP, EP. The eight
# plans of issue 41 are marked.
PLANS: list[tuple] = [
    ("1 rank", 1, "zero_stage = 0"),
    ("1 rank mbs 2", 1, "zero_stage = 0\nmicro_batch_size = 2"),  # issue 41
    ("1 rank recompute selective", 1, 'zero_stage = 0\nrecompute = "selective"'),
    ("1 rank recompute full", 1, 'zero_stage = 0\nrecompute = "full"'),  # issue 41
    ("dp2 (DDP)", 2, "zero_stage = 0"),
    ("dp2 DDP mbs 1", 2, "zero_stage = 0\nmicro_batch_size = 1"),  # issue 41
    ("dp2 zero 1", 2, "zero_stage = 1"),  # issue 41
    ("dp2 zero 2", 2, "zero_stage = 2"),
    ("dp2 zero 3 (FSDP2)", 2, "zero_stage = 3"),
    ("tp2", 2, "tp = 2\nsequence_parallel = false"),  # the spec's default is true when tp > 1
    ("tp2 + sp", 2, "tp = 2\nsequence_parallel = true"),
    ("tp2 + sp selective", 2, 'tp = 2\nsequence_parallel = true\nrecompute = "selective"'),  # 41
    ("pp2 1F1B", 2, 'pp = 2\npp_schedule = "1f1b"'),
    ("pp2 interleaved", 2, 'pp = 2\nvpp = 2\npp_schedule = "interleaved-1f1b"'),  # issue 41
    ("pp2 ZBV", 2, 'pp = 2\nvpp = 2\npp_schedule = "zbv"'),  # issue 41
    ("cp2", 2, "cp = 2"),
    ("cp2 zero 3", 2, "cp = 2\nzero_stage = 3"),  # issue 41
    ("1 rank MoE", 1, "zero_stage = 0", MOE),
    ("ep2 MoE", 2, "ep = 2\nzero_stage = 0", MOE),
    # torch.compile of each block (issue 41 item 3), beside "1 rank" (its eager twin): Inductor
    # needs a C compiler; the first step compiles (about 40 s here) and is not compared
    ("1 rank compiled", 1, "zero_stage = 0", "", "compile = true"),
]


# --gpu: one-GPU plans of a model large enough to keep an H100 busy (about 1.2 B parameters,
# seq 2048), priced for the catalog GPU the machine has; no calibration (the catalog's figures).
GPU_VOCAB = 32000
GPU_MODEL = f"""[model]
preset = "tiny-llama"
num_layers = 16
hidden_size = 2048
num_attention_heads = 16
num_kv_heads = 8
ffn_hidden_size = 7168
vocab_size = {GPU_VOCAB}
seq_length = 2048
"""
GPU_PLANS = [
    ("mbs 1", 1, "micro_batch_size = 1"),
    ("mbs 2", 1, "micro_batch_size = 2"),
    ("mbs 1, recompute selective", 1, 'micro_batch_size = 1\nrecompute = "selective"'),
    ("mbs 1, recompute full", 1, 'micro_batch_size = 1\nrecompute = "full"'),
    ("mbs 2, recompute full", 1, 'micro_batch_size = 2\nrecompute = "full"'),
    ("mbs 4, recompute full", 1, 'micro_batch_size = 4\nrecompute = "full"'),
]


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation: Pearson's over the ranks, tied values (two plans the model
    prices alike) sharing their average rank."""

    def ranks(x: list[float]) -> list[float]:
        order = sorted(range(len(x)), key=x.__getitem__)
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)
    return cov / var**0.5 if var else 0.0


def select(plans: list[tuple], names: list[str] | None) -> list[tuple[str, int, str, str, str]]:
    """The plans named (all of them without names), in the table's order, each as (name,
    ranks, [parallel] lines, extra [model] lines, extra [training] lines)."""
    full = [(*p, "", "")[:5] for p in plans]
    if not names:
        return full
    known = [p[0] for p in full]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"--plans: no plan named {unknown}; the plans are {known}")
    return [p for p in full if p[0] in names]


def batch_lines(parallel: str, default_mbs: int | None, gbs: int) -> str:
    """The plan's batch: its own micro_batch_size where it sets one, else the default."""
    mbs = "" if "micro_batch_size" in parallel or default_mbs is None else default_mbs
    return (f"micro_batch_size = {mbs}\n" if mbs else "") + f"global_batch_size = {gbs}"


def calibrate(folder: Path, nproc: int) -> Path:
    spec = folder / f"base{nproc}.toml"
    spec.write_text(MODEL + f"[cluster]\ngpu = 'h100-sxm'\nnum_gpus = {nproc}\n")
    cal = folder / f"cal{nproc}.toml"
    cmd = [
        sys.executable, "-m", "aihpc", "calibrate", "--local", "--nproc", str(nproc),
        "--spec", str(spec), "-O", str(cal),
    ]  # fmt: skip
    r = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=3600, env=ENV)
    if r.returncode:
        raise SystemExit(f"calibrate --local failed: {r.stderr.strip()[-400:]}")
    return folder / f"base{nproc}.local.toml"


def train(
    folder: Path, tag: str, text: str, nproc: int, name: str, data: Path | None = None
) -> tuple[dict, list[float]]:
    """Train one plan (on ``data``, a token array, else the built-in text); its summary's
    `performance` and the step times after the warm-up (the first WARMUP steps)."""
    spec = folder / f"plan{tag}.toml"
    spec.write_text(text)
    run = folder / f"run{tag}"
    cmd = [
        sys.executable, "-m", "aihpc", "train", str(spec), "--run-dir", str(run),
        "--nproc-per-node", str(nproc), "--json",
    ]  # fmt: skip
    if data is not None:
        cmd += ["--data", str(data)]
    r = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=1800, env=ENV)
    if r.returncode:
        raise SystemExit(f"{name}: aihpc train failed: {r.stderr.strip()[-400:]}")
    perf = json.loads((run / "summary.json").read_text())["performance"]
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return perf, [json.loads(x)["step_time_s"] for x in lines][WARMUP:]


def calibration_summary(clusters: dict) -> dict:
    """What each calibration measured: the best GEMM rate, the attention kernel, and each
    collective's latencies and bandwidths inside a step, with the host's overlap penalty."""
    out = {}
    for n, data in clusters.items():
        cluster = data["cluster"]
        spec = cluster.get("gpu_spec", {})
        entry = {"best_gemm_tflops": spec.get("fp32_tflops")}
        cal = cluster.get("calibration")
        if cal:
            doc = tomllib.loads(Path(cal).read_text())
            entry["latency_us"] = {
                c["collective"]: [r["latency_us"] for r in c["regimes"]]
                for c in doc.get("comm", [])
            }
            entry["busbw_GBps"] = {
                c["collective"]: [r["busbw_GBps"] for r in c["regimes"]]
                for c in doc.get("comm", [])
            }
            entry["overlap_compute_penalty"] = doc.get("overlap_compute_penalty")
            entry["dtensor_op_us"] = doc.get("dtensor_op_us")
            entry["dtensor_optimizer_op_us"] = doc.get("dtensor_optimizer_op_us")
        for key in (
            "attention_fwd_efficiency",
            "attention_bwd_efficiency",
            "attention_tokens",
            "hbm_bw_GBps",
            "host_op_us",
            "page_fault_us",
            "fresh_fault_fraction",
        ):
            entry[key] = spec.get(key)
        out[str(n)] = entry
    return out


def local_clusters(folder: Path, ranks: list[int]) -> dict[int, dict]:
    """``[cluster]`` tables for this host as each rank count, calibrated in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    clusters = {n: tomllib.loads(calibrate(folder, n).read_text()) for n in ranks}
    for data in clusters.values():  # the calibration's path, relative to the folder
        cal = data["cluster"].get("calibration")
        if cal:
            data["cluster"]["calibration"] = str(folder / cal)
    return clusters


def run_rounds(
    args: argparse.Namespace, folder: Path
) -> tuple[list[dict], list[dict], dict[str, str]]:
    """Every plan trained ``args.rounds`` times, round-robin; (one row per plan, what each
    round's calibration measured, the plans that failed with why). On a CPU each round
    calibrates this host afresh, and a plan's prediction is the median over the rounds: one
    calibration is noisy (one transient load during a calibration moved the 1-rank prediction
    by 35%, 250 -> 340 ms, between two runs of the same code), in both directions."""
    data = None
    if args.gpu:
        plans, model, mbs = select(GPU_PLANS, args.plans), GPU_MODEL, None
        gpu_cluster = {1: {"cluster": {"gpu": catalog_gpu(), "num_gpus": 1, "gpus_per_node": 1}}}
        # random token ids for the model's vocabulary (the built-in text is bytes)
        data = folder / "tokens.npy"
        rng = np.random.default_rng(0)
        np.save(data, rng.integers(0, GPU_VOCAB, size=1 << 20, dtype=np.int32))
    else:
        plans, model, mbs = select(PLANS, args.plans), MODEL, 4
    ranks = sorted({p[1] for p in plans})
    times: dict[str, list[list[float]]] = {p[0]: [] for p in plans}
    preds: dict[str, list[float]] = {p[0]: [] for p in plans}
    loads: dict[str, list[float]] = {p[0]: [] for p in plans}
    summaries: list[dict] = []
    failed: dict[str, str] = {}
    for rnd in range(args.rounds):
        clusters = gpu_cluster if args.gpu else local_clusters(folder / f"round{rnd}", ranks)
        if not args.gpu:
            summaries.append(calibration_summary(clusters))
        # each round starts further down the table, so no plan always runs first after a
        # calibration, or always beside the same neighbour's burst of load
        start = rnd * len(plans) // max(1, args.rounds)
        order = list(enumerate(plans))[start:] + list(enumerate(plans))[:start]
        for i, (name, nproc, par, model_extra, train_extra) in order:
            if name in failed:
                continue
            text = (
                model
                + model_extra
                + dumps_toml({"cluster": clusters[nproc]["cluster"]})
                + f"\n[parallel]\n{par}\n{batch_lines(par, mbs, 8)}\n"
                + TRAIN.format(steps=args.steps).replace(
                    "[checkpoint]", train_extra + "\n[checkpoint]"
                )
            )
            load = os.getloadavg()[0]
            try:
                perf, steps = train(folder, f"{i}-{rnd}", text, nproc, name, data)
            except SystemExit as err:  # one plan the trainer refuses does not end the run
                failed[name] = str(err)
                print(err, flush=True)
                continue
            times[name].append(steps)
            preds[name].append(perf["predicted_step_time_s"])
            loads[name].append(max(load, os.getloadavg()[0]))
            print(
                f"round {rnd + 1}, {name}: median step {statistics.median(steps) * 1e3:.1f} ms, "
                f"fastest {min(steps) * 1e3:.1f} ms, predicted {preds[name][-1] * 1e3:.1f} ms",
                flush=True,
            )
    return plan_rows(plans, times, preds, loads, failed), summaries, failed


def plan_rows(
    plans: list[tuple], times: dict, preds: dict, loads: dict, failed: dict
) -> list[dict]:
    """One row per plan that ran: its measured step (the median over rounds of each round's
    median step), fastest step, prediction (the median of its rounds'), load and errors."""
    rows = []
    for name, nproc, *_ in plans:
        if name in failed:
            continue
        by_round = [statistics.median(steps) for steps in times[name]]
        best = min(min(steps) for steps in times[name])
        # the median over rounds of each round's median step: one round slowed by a neighbour
        # moves it no more than one value of several
        med = statistics.median(by_round)
        pred = statistics.median(preds[name])
        rows.append(
            {
                "plan": name,
                "ranks": nproc,
                "measured_s": med,  # the median step after the warm-up: the typical step
                "measured_by_round_s": by_round,
                "fastest_s": best,
                "predicted_s": pred,
                "predicted_by_round_s": preds[name],
                "steps_compared": sum(len(steps) for steps in times[name]),
                "load_by_round": loads[name],  # the 1-minute load average, the higher of
                # the plan's start and end
                "error": pred / med - 1,
                "error_vs_fastest": pred / best - 1,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1, help="train every plan this many times")
    ap.add_argument("--gpu", action="store_true", help="one-GPU plans on this machine's GPU")
    ap.add_argument(
        "--plans", nargs="+", metavar="NAME", help="train only these plans (default: all)"
    )
    add_results_arg(ap)
    args = ap.parse_args()
    load_start = os.getloadavg()  # the end's is in machine(): other jobs share a small host
    with tempfile.TemporaryDirectory(prefix="aihpc-pvm-") as tmp:
        rows, cal_summary, failed = run_rounds(args, Path(tmp))
    med = statistics.median(abs(r["error"]) for r in rows)
    worst = max(rows, key=lambda r: abs(r["error"]))
    over = sum(r["error"] > 0 for r in rows)
    rho = None  # a rank order needs three plans
    if len(rows) > 2:
        rho = spearman([r["measured_s"] for r in rows], [r["predicted_s"] for r in rows])
    table = "\n".join(
        [
            "| plan | ranks | median ms | fastest ms | predicted ms | error (vs median) | "
            "vs fastest | load |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
            *(
                f"| {r['plan']} | {r['ranks']} | {r['measured_s'] * 1e3:.1f} | "
                f"{r['fastest_s'] * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f} | {r['error']:+.0%} | "
                f"{r['error_vs_fastest']:+.0%} | {max(r['load_by_round']):.1f} |"
                for r in rows
            ),
            "",
            f"Against the median step after {WARMUP} warm-up steps: median |error| {med:.0%} "
            f"(target <= 10%), worst {worst['error']:+.0%} ({worst['plan']}), Spearman rho "
            + ("-" if rho is None else f"{rho:.2f}")
            + f" (target >= 0.85); {over} of {len(rows)} predictions above the measured step "
            f"(pessimistic), {len(rows) - over} below (optimistic). Load: the 1-minute load "
            "average while the plan ran (the highest over its rounds); on this 2-core host a "
            "plan whose load is above 1 shared the cores with other work.",
        ]
    )
    data = {"machine": machine(), "steps": args.steps, "rounds": args.rounds, "plans": rows}
    data["calibration_by_round"] = cal_summary
    data["failed"] = failed
    data["load_avg_start"] = load_start
    data.update(
        median_abs_error=med,
        worst_error=worst["error"],
        spearman_rho=rho,
        pessimistic=over,
        optimistic=len(rows) - over,
        warmup_steps=WARMUP,
    )
    name = "predicted_vs_measured_gpu" if args.gpu else "predicted_vs_measured"
    save(name, data, table, args.results)


if __name__ == "__main__":
    main()
