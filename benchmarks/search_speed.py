"""Planner speed: aihpc's full plan search for Llama-3-405B on 16,384 H100-SXM (global batch 2048,
seq 8192) against llm-analysis evaluating the same configurations, one core, side by side; how the
search time grows with the cluster (64 to 131,072 GPUs) and with the model; and a whole
`aihpc search` process, import time included.

    python benchmarks/search_speed.py             # prints the table, writes ./benchmark-results/
    python benchmarks/search_speed.py --sample 500 --repeats 5

llm-analysis (PyPI, 0.2.2) is optional and not an aihpc dependency: ``pip install
llm-analysis==0.2.2`` into the environment to measure that half; without it the half is skipped.
This is a speed comparison only: the two tools model different things, so nothing here compares
their predictions.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

# One core: single-threaded BLAS/OpenMP, set before anything imports numpy.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = "1"

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import add_results_arg  # noqa: E402

TARGET_S = 0.1  # compute (CPU) seconds of the full search on one core (issue 21)
PROCESS_TARGET_S = 0.5  # a whole `aihpc search` process, interpreter start and imports included
GPU_SWEEP = (64, 256, 1024, 4096, 16384, 65536, 131072)
MODEL_SWEEP = ("llama3-8b", "llama3-70b", "llama3-405b", "mixtral-8x7b", "deepseek-v3")
SPEC = {
    "model": {"preset": "llama3-405b"},
    "cluster": {"gpu": "h100-sxm", "num_gpus": 16384, "gpus_per_node": 8},
    "parallel": {"global_batch_size": 2048},
}


def pin_one_core() -> str:
    """Pin this process to one CPU (where the OS allows it)."""
    if not hasattr(os, "sched_setaffinity"):
        return "not pinned (no sched_setaffinity on this OS); BLAS threads = 1"
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    return "pinned to 1 CPU; OMP/MKL/OPENBLAS threads = 1"


def best_of(fn, repeats: int) -> tuple[float, list[float], object]:  # type: ignore[no-untyped-def]
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), times, result


def cpu_best_of(fn, repeats: int) -> tuple[float, float, object]:  # type: ignore[no-untyped-def]
    """(best CPU seconds of this process, best wall seconds, result): on a shared machine the
    CPU time is what the search itself costs; the wall time adds whatever else ran."""
    cpu, wall, result = [], [], None
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        result = fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return min(cpu), min(wall), result


def sample_evenly(items: list, n: int) -> list:
    """n items spread evenly over the list (the candidate list is ordered by tp, pp, cp, ...,
    so its first n would all be tp=1 plans)."""
    if n >= len(items):
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def aihpc_half(repeats: int, n_sample: int) -> tuple[dict, list]:
    from aihpc.perf.search.ranking import candidate_plans, search
    from aihpc.perf.step.estimate import estimate_plan
    from aihpc.runspec import runspec_from_dict

    spec = runspec_from_dict(SPEC)
    search(spec, top=10)  # warm: first-call costs (lazy imports, caches) are not the search's
    best, times, result = best_of(lambda: search(spec, top=10), repeats)
    cpu_s, _, _ = cpu_best_of(lambda: search(spec, top=10), repeats)
    candidates = list(candidate_plans(spec.model, spec.cluster, spec.parallel))
    sample = sample_evenly(candidates, n_sample)

    def estimate_sample() -> int:
        for plan in sample:
            estimate_plan(spec.model, spec.cluster, plan, spec.training, check=False)
        return len(sample)

    s_best, s_times, _ = best_of(estimate_sample, repeats)
    s_cpu, _, _ = cpu_best_of(estimate_sample, repeats)
    top = result.plans[0] if result.plans else None
    out = {
        "full_search": {
            "evaluated": result.evaluated,
            "feasible": result.feasible,
            "candidates": len(candidates),
            "wall_s_runs": times,
            "wall_s_best": best,
            "cpu_s_best": cpu_s,
            "us_per_plan_cpu": cpu_s / result.evaluated * 1e6,
            "plans_per_s": result.evaluated / cpu_s,
            "target_cpu_s": TARGET_S,
            "meets_target": cpu_s <= TARGET_S,
            "best_plan": None
            if top is None
            else {**asdict(top.plan), "tokens_per_s_per_gpu": top.tokens_per_s_per_gpu},
        },
        "same_sample": {
            "what": "estimate_plan, one plan at a time, on the sample llm-analysis evaluates",
            "configs": len(sample),
            "wall_s_runs": s_times,
            "wall_s_best": s_best,
            "cpu_s_best": s_cpu,
            "configs_per_s": len(sample) / s_cpu,
        },
        "model": {
            "num_layers": spec.model.num_layers,
            "hidden_size": spec.model.hidden_size,
            "num_attention_heads": spec.model.num_attention_heads,
            "num_kv_heads": spec.model.num_kv_heads,
            "ffn_hidden_size": spec.model.ffn_hidden_size,
            "vocab_size": spec.model.vocab_size,
            "seq_length": spec.model.seq_length,
        },
    }
    return out, sample


def llm_analysis_half(sample: list, model: dict, repeats: int) -> dict | None:
    try:
        from llm_analysis.analysis import ActivationRecomputation, DSZeRO, LLMAnalysis
        from llm_analysis.config import DtypeConfig, GPUConfig, ModelConfig, ParallelismConfig
        from llm_analysis.logger import logger
    except ImportError:
        print(
            "llm-analysis is not installed (pip install llm-analysis==0.2.2): "
            "skipping the llm-analysis half.",
            file=sys.stderr,
        )
        return None
    logger.setLevel(logging.CRITICAL + 1)
    version = metadata.version("llm-analysis")
    h, ffn = model["hidden_size"], model["ffn_hidden_size"]
    model_config = ModelConfig(
        name="llama3-405b-shaped",
        num_layers=model["num_layers"],
        n_head=model["num_attention_heads"],
        hidden_dim=h,
        vocab_size=model["vocab_size"],
        max_seq_len=model["seq_length"],
        num_key_value_heads=model["num_kv_heads"],
        ffn_embed_dim=ffn,
        expansion_ratio=ffn / h,  # 3.25: not an integer, so it must be given explicitly
        model_type="llama",
    )
    gpu_config = GPUConfig(
        name="h100-sxm-like",
        mem_per_GPU_in_GB=80,
        hbm_bandwidth_in_GB_per_sec=3350,
        intra_node_bandwidth_in_GB_per_sec=450,  # NVLink, per direction
        intra_node_min_message_latency=8e-6,
        peak_fp16_TFLOPS=989,  # dense BF16
        inter_node_bandwidth_in_GB_per_sec=50,  # one 400 Gb/s IB NIC per GPU
    )
    # 0.2.2 has three levels (NONE=0, SELECTIVE=1, FULL=2); later releases split selective into
    # finer levels (ATTN_COMPUTE=1 ... FULL=4). Map by name so either works.
    levels = ActivationRecomputation.__members__
    recompute = {
        "none": levels["NONE"],
        "selective": levels.get("SELECTIVE", levels.get("ATTN_COMPUTE")),
        # llm-analysis has no op-level policy: its selective level is the nearest
        "op": levels.get("SELECTIVE", levels.get("ATTN_COMPUTE")),
        "full": levels["FULL"],
    }
    seq = model["seq_length"]
    failures: list[str] = []

    def evaluate_sample() -> int:
        failures.clear()
        for p in sample:
            try:
                analysis = LLMAnalysis(
                    model_config,
                    gpu_config,
                    DtypeConfig(),  # w16a16e16: BF16 weights and activations
                    ParallelismConfig(
                        tp_size=p.tp,
                        pp_size=p.pp,
                        dp_size=p.dp,  # cp dropped: the config spans tp*pp*dp = N/cp GPUs
                        sp_size=p.tp if p.sequence_parallel else 1,
                    ),
                )
                analysis.training(
                    batch_size_per_gpu=p.micro_batch_size,
                    global_batch_size=p.global_batch_size,
                    seq_len=seq,
                    activation_recomputation=recompute[p.recompute],
                    ds_zero=DSZeRO(p.zero_stage),
                    flash_attn=True,
                    mlp_gated_linear_units=True,
                )
            except Exception as err:  # counted and reported, not hidden
                failures.append(f"{p}: {err!r}"[:300])
        return len(sample)

    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        best, times, _ = best_of(evaluate_sample, repeats)
        cpu_s, _, _ = cpu_best_of(evaluate_sample, repeats)
    return {
        "version": version,
        "configs": len(sample),
        "wall_s_runs": times,
        "wall_s_best": best,
        "cpu_s_best": cpu_s,
        "configs_per_s": len(sample) / cpu_s,
        "us_per_config": cpu_s / len(sample) * 1e6,
        "failures": len(failures),
        "failure_examples": failures[:5],
        "output_suppressed_chars": len(sink.getvalue()),
        "mapping": {
            "tp": "tp_size",
            "pp": "pp_size (126 layers not divisible by pp: llm-analysis takes the floor)",
            "dp": "dp_size",
            "sequence_parallel": "sp_size = tp if SP else 1",
            "zero_stage": "ds_zero = DSZeRO(zero_stage)",
            "recompute": {k: f"{v.name} ({v.value})" for k, v in recompute.items()},
            "micro_batch_size": "batch_size_per_gpu",
            "global_batch_size": "global_batch_size",
            "cp": "not expressible: evaluated with cp=1, keeping dp (so on N/cp GPUs)",
            "vpp": "not expressible: evaluated with vpp=1 (no interleaving)",
        },
        "sample_with_cp_gt_1": sum(p.cp > 1 for p in sample),
        "sample_with_vpp_gt_1": sum(p.vpp > 1 for p in sample),
    }


def sweep_row(spec_dict: dict, repeats: int) -> dict:
    from aihpc.perf.search.candidates import candidate_batch
    from aihpc.perf.search.ranking import search
    from aihpc.runspec import runspec_from_dict

    spec = runspec_from_dict(spec_dict)
    search(spec, top=10)
    cpu_s, wall_s, result = cpu_best_of(lambda: search(spec, top=10), repeats)
    combos = len(candidate_batch(spec.model, spec.cluster, spec.parallel))
    return {
        "model": spec_dict["model"]["preset"],
        "num_gpus": spec.cluster.num_gpus,
        "global_batch_size": spec_dict["parallel"]["global_batch_size"],
        "combinations": combos,
        "evaluated": result.evaluated,
        "feasible": result.feasible,
        "cpu_s_best": cpu_s,
        "wall_s_best": wall_s,
        "us_per_plan_cpu": cpu_s / max(1, result.evaluated) * 1e6,
    }


def sweeps(repeats: int) -> dict:
    """Search time against cluster size (Llama 3 405B; the global batch 2048 sequences, or
    num_gpus / 8 where that is larger, so that dp can still grow) and against the model
    (16,384 H100, global batch 2048)."""
    gpus = []
    for n in GPU_SWEEP:
        spec = {**SPEC, "cluster": {**SPEC["cluster"], "num_gpus": n}}
        spec["parallel"] = {"global_batch_size": max(2048, n // 8)}
        gpus.append(sweep_row(spec, repeats))
    models = [sweep_row({**SPEC, "model": {"preset": name}}, repeats) for name in MODEL_SWEEP]
    return {"gpus": gpus, "models": models}


def process_times(repeats: int) -> dict:
    """A whole `aihpc search SPEC --top 10 --json` process, and one that only imports the CLI.

    Bytecode cached, as in an installed package (pip compiles it at install): the processes
    share a temporary PYTHONPYCACHEPREFIX that an untimed first run of each fills, whatever
    PYTHONDONTWRITEBYTECODE the caller has set (with it, each run recompiled aihpc's source).
    """
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama3-405b-16k-search.toml"
        path.write_text(
            '[model]\npreset = "llama3-405b"\n[cluster]\ngpu = "h100-sxm"\n'
            "num_gpus = 16384\ngpus_per_node = 8\n[parallel]\nglobal_batch_size = 2048\n"
        )
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONPYCACHEPREFIX": tmp}
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        run = [sys.executable, "-c", "from aihpc.cli import main; main()"]
        cmds = {
            "search": [*run, "search", str(path), "--top", "10", "--json"],
            "import_only": [sys.executable, "-c", "import aihpc.cli"],
            "python_only": [sys.executable, "-c", "pass"],
        }
        out = {}
        for name, cmd in cmds.items():
            subprocess.run(cmd, env=env, check=True, capture_output=True)  # fills the cache
            walls, cpus = [], []
            for _ in range(repeats):
                before = os.times()
                t0 = time.perf_counter()
                subprocess.run(cmd, env=env, check=True, capture_output=True)
                walls.append(time.perf_counter() - t0)
                after = os.times()
                cpus.append(
                    after.children_user
                    + after.children_system
                    - before.children_user
                    - before.children_system
                )
            out[name] = {"wall_s_best": min(walls), "cpu_s_best": min(cpus), "wall_s_runs": walls}
    out["bytecode"] = "cached (a temporary PYTHONPYCACHEPREFIX filled by an untimed run)"
    out["typer"] = metadata.version("typer")
    out["target_s"] = PROCESS_TARGET_S
    out["meets_target"] = out["search"]["cpu_s_best"] <= PROCESS_TARGET_S
    return out


def render_process(p: dict) -> list[str]:
    s, i, py = p["search"], p["import_only"], p["python_only"]
    verdict = "meets" if p["meets_target"] else "misses"
    return [
        "Whole process, `aihpc search` of the same spec with `--top 10 --json` (best of "
        f"{len(s['wall_s_runs'])} runs): **{s['cpu_s_best']:.3f} s of CPU** "
        f"({s['wall_s_best']:.3f} s wall), {verdict} the {p['target_s']} s target; of it, "
        f"starting Python takes {py['cpu_s_best']:.3f} s and importing the CLI "
        f"{i['cpu_s_best'] - py['cpu_s_best']:.3f} s more (bytecode cached, as installed; "
        f"typer {p['typer']}).",
        "",
    ]


def render_sweeps(sw: dict) -> list[str]:
    head = [
        "| model | GPUs | global batch | combinations | plans evaluated | fit | CPU s | µs/plan |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def rows(items: list[dict]) -> list[str]:
        return [
            f"| {r['model']} | {r['num_gpus']:,} | {r['global_batch_size']:,} | "
            f"{r['combinations']:,} | {r['evaluated']:,} | {r['feasible']:,} | "
            f"{r['cpu_s_best']:.3f} | {r['us_per_plan_cpu']:.2f} |"
            for r in items
        ]

    return [
        "## How the search time grows",
        "",
        "With the cluster (Llama 3 405B, H100; the global batch is 2,048 sequences or num_gpus / 8 "
        "where larger, so that data parallelism can still grow). Combinations: every enumerated "
        "candidate before the divisibility rules.",
        "",
        *head,
        *rows(sw["gpus"]),
        "",
        "With the model (16,384 H100, global batch 2,048; MoE models also search ep and etp):",
        "",
        *head,
        *rows(sw["models"]),
        "",
    ]


def render(res: dict) -> str:
    a, s, la = res["aihpc"]["full_search"], res["aihpc"]["same_sample"], res["llm_analysis"]
    base = la["configs_per_s"] if la else None

    def ratio(x: float) -> str:
        return f"{x / base:.1f}x" if base else "n/a"

    rows = [
        ("aihpc full search (arrays of plans)", a["evaluated"], a["cpu_s_best"], a["plans_per_s"]),
        (
            "aihpc, same sample, one estimate_plan each",
            s["configs"],
            s["cpu_s_best"],
            s["configs_per_s"],
        ),
    ]
    if la:
        rows.append((f"llm-analysis {la['version']}", la["configs"], la["cpu_s_best"], base))
    lines = [
        "| tool | configurations evaluated | CPU seconds (best of "
        f"{res['repeats']}) | µs per configuration | ratio (aihpc / llm-analysis) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, n, sec, rate in rows:
        lines.append(f"| {name} | {n:,} | {sec:.4f} | {1e6 / rate:.2f} | {ratio(rate)} |")
    verdict = "meets" if a["meets_target"] else "misses"
    out = [
        "# Planner speed: aihpc search vs llm-analysis",
        "",
        f"Produced by `{res['command']}` on {res['date']} "
        f"(Python {res['python']}, {res['cpu']}, {res['cores']}; "
        f"load average {res['loadavg_before']} before, {res['loadavg_after']} after: "
        "the machine was shared, so these are upper bounds on time).",
        "",
        "Workload: Llama-3-405B (126 layers, hidden 16384, 128 heads / 8 KV heads, SwiGLU FFN "
        "53248, vocab 128256, seq 8192) on 16,384 H100-SXM, 8 per node, global batch 2048.",
        "",
        *lines,
        "",
        f"aihpc full search: **{a['cpu_s_best']:.3f} s of CPU** ({a['wall_s_best']:.3f} s wall) "
        f"for {a['evaluated']:,} plans ({a['feasible']:,} fit in memory), {verdict} the "
        f"{TARGET_S} s target; wall runs: {', '.join(f'{t:.3f}' for t in a['wall_s_runs'])} s.",
        "",
        *render_process(res["process"]),
        *render_sweeps(res["sweeps"]),
    ]
    if la:
        m = la["mapping"]
        out += [
            f"llm-analysis evaluated an evenly spaced sample of {la['configs']} of aihpc's "
            f"{a['candidates']:,} candidate plans (every ~{a['candidates'] // la['configs']}th; "
            "the list starts with its tp = 1 plans), one `LLMAnalysis(...)` + `.training(...)` per "
            f"plan with its logging silenced: {la['us_per_config']:.0f} µs of CPU per "
            f"configuration, {la['failures']} raised. The per-configuration ratio is the first "
            "row's: aihpc's whole search (enumeration, divisibility rules, pricing every plan, "
            "ranking, and the ten best estimated one by one) per plan it evaluates, against "
            "llm-analysis per configuration. The second row prices the same sample one "
            "`estimate_plan` call at a time (the single-plan path `aihpc estimate` uses).",
            "",
            "Mapping: tp → tp_size, pp → pp_size, dp → dp_size, sequence parallel → "
            "sp_size = tp (else 1), ZeRO stage → ds_zero, micro-batch → batch_size_per_gpu, "
            "global batch → global_batch_size, recompute none/selective/op/full → "
            + ", ".join(m["recompute"].values())
            + " (0.2.2 has only these three levels). Not expressible in llm-analysis: "
            f"context parallelism ({la['sample_with_cp_gt_1']} of the sample have cp > 1: "
            "evaluated with cp = 1, keeping dp, i.e. on N/cp GPUs) and interleaved pipeline "
            f"stages ({la['sample_with_vpp_gt_1']} have vpp > 1: evaluated with vpp = 1). "
            "Model: ModelConfig with the shape above (expansion ratio 3.25, gated MLP "
            "activations via `mlp_gated_linear_units=True`); GPU: GPUConfig with 989 TFLOP/s "
            "BF16, 80 GB, 3.35 TB/s HBM, NVLink 450 GB/s, IB 50 GB/s per GPU.",
            "",
            "Speed only: the tools model different things, so their predictions are not "
            "compared here.",
            "",
        ]
    else:
        out += ["llm-analysis not installed: that half was skipped.", ""]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sample", type=int, default=500, help="plans given to llm-analysis")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (best)")
    ap.add_argument("--no-save", action="store_true", help="print only")
    add_results_arg(ap)
    args = ap.parse_args()
    command = " ".join(["python", "benchmarks/search_speed.py", *sys.argv[1:]])
    pinned = pin_one_core()
    load_before = [round(x, 2) for x in os.getloadavg()]
    aihpc, sample = aihpc_half(args.repeats, args.sample)
    la = llm_analysis_half(sample, aihpc["model"], args.repeats)
    process = process_times(args.repeats)
    sweep = sweeps(args.repeats)
    res = {
        "command": command,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cores": pinned,
        "loadavg_before": load_before,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "repeats": args.repeats,
        "spec": SPEC,
        "aihpc": aihpc,
        "llm_analysis": la,
        "process": process,
        "sweeps": sweep,
        "ratio_full_search_vs_llm_analysis": (
            aihpc["full_search"]["plans_per_s"] / la["configs_per_s"] if la else None
        ),
        "ratio_same_sample_vs_llm_analysis": (
            aihpc["same_sample"]["configs_per_s"] / la["configs_per_s"] if la else None
        ),
    }
    text = render(res)
    print(text)
    if not args.no_save:
        args.results.mkdir(parents=True, exist_ok=True)
        (args.results / "search_speed.json").write_text(json.dumps(res, indent=2) + "\n")
        (args.results / "search_speed.md").write_text(text)
        print(f"written to {args.results}/search_speed.{{json,md}}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
