"""The inference estimate's prefill and decode-step times against the trainer's Llama decoding
with its KV cache, across batch, prompt and output length, on this host.

    python benchmarks/inference_vs_measured.py [--repeats 3] [--results DIR]
    python benchmarks/inference_vs_measured.py --batches 1 4 --prompts 64 256 --outputs 32
    python benchmarks/inference_vs_measured.py --spec HOST.local.toml   # no calibration
    python benchmarks/inference_vs_measured.py --gpu   # the machine's GPU, bf16, catalog part

1. `aihpc calibrate --local --nproc 1` measures this host for the benchmark's model (GEMMs at
   one thread, memory bandwidth, the model's attention calls) and writes a gpu_spec whose
   `host_is_device` says the CPU runs every op's dispatch before its work (as
   predicted_vs_measured.py does for training; ``--spec`` names a copy written before);
2. one process, one thread (OMP_NUM_THREADS=1, as the training benchmark runs each rank),
   float32 (the trainer's precision on a CPU): the model (about 24 M parameters, 94 MB, more
   than the host's last-level cache, so a decode step reads its weights from memory) prefills
   ``batch`` random prompts of ``prompt`` tokens (Llama.prefill, the cache sized for the
   longest output), then decodes; each (batch, prompt) runs once as a warm-up and
   ``--repeats`` times measured;
3. per row: prefill = the median prefill; decode step = for each output length O, the mean of
   the first O - 1 decode steps (what a request of O tokens runs after its prefill), median
   over the repeats; prediction = `aihpc.perf.infer.estimate_inference` for the calibrated
   host (its ``prefill_s`` and ``decode_step_s``, the latter at the mean context prompt +
   O / 2), error = predicted / measured - 1; over rows: median |error|, the worst, and
   Spearman's rho between predicted and measured (targets: median <= 20%, ranking right).
4. on a CPU, a calibration step of the benchmark's own, on the clock it times the model on
   (thread CPU time; `calibrate --local` times GEMMs on the wall clock, which a loaded host
   stretches): the model's own linears at 16-1024 rows (a GEMM curve), at one row (the rate a
   matrix-vector product streams weights, ``weight_stream_GBps``) and one eager op's host time
   (``host_cpu_op_s``), and the model's causal attention call at 1024 and 512 tokens (the
   attention efficiency and its fall-off); the estimate is given twice, on the spec alone and
   with this step.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import add_results_arg, catalog_gpu, machine, save
from predicted_vs_measured import spearman

MODEL = """[model]
preset = "tiny-llama-small"
num_layers = 8
hidden_size = 512
num_attention_heads = 8
num_kv_heads = 4
ffn_hidden_size = 1408
seq_length = 1280
"""
TINY_MODEL = """[model]
preset = "tiny-llama"
seq_length = 64
"""
# --gpu: a model that keeps an H100 busy at decode's small batches (about 1.2 B parameters)
GPU_MODEL = """[model]
preset = "tiny-llama"
num_layers = 16
hidden_size = 2048
num_attention_heads = 16
num_kv_heads = 8
ffn_hidden_size = 7168
vocab_size = 32000
seq_length = 4096
"""
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def calibrate(folder: Path, model: str) -> Path:
    """This host's copy of a one-rank spec of ``model`` (`aihpc calibrate --local`)."""
    spec = folder / "base.toml"
    spec.write_text(model + "[cluster]\ngpu = 'h100-sxm'\nnum_gpus = 1\n")
    cmd = [
        sys.executable, "-m", "aihpc", "calibrate", "--local", "--nproc", "1",
        "--spec", str(spec), "-o", str(folder / "cal.toml"),
    ]  # fmt: skip
    r = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=3600, env=ENV)
    if r.returncode:
        raise SystemExit(f"calibrate --local failed: {r.stderr.strip()[-400:]}")
    return folder / "base.local.toml"


def host_spec(args: argparse.Namespace, folder: Path, model: str):
    """The run spec that prices this machine: --spec, a fresh calibration, or (--gpu) the
    catalog part of the machine's GPU."""
    from aihpc.runspec import load_runspec

    if args.spec is not None:
        return load_runspec(args.spec)
    if args.gpu:
        path = folder / "gpu.toml"
        path.write_text(model + f"[cluster]\ngpu = '{catalog_gpu()}'\nnum_gpus = 1\n")
        return load_runspec(path)
    return load_runspec(calibrate(folder, model))


def build_model(spec, device):
    import torch

    from aihpc.runtime import Llama, LlamaConfig

    model = Llama(LlamaConfig.from_spec(spec.model)).to(device)
    model.init_weights(0)
    return model.eval().to(torch.bfloat16 if device.type == "cuda" else torch.float32)


def measure(model, batch: int, prompt: int, steps: int, repeats: int, device) -> dict:
    """Prefill times (one per repeat, after a warm-up) and, per repeat, every decode step's;
    on a CPU each on the thread's CPU clock (``prefill``, ``decode``: the time the work takes
    on a core of its own, what a host shared with other jobs does not stretch; one thread does
    all the work) and on the wall clock (``*_wall``); on a GPU on the wall clock after a
    synchronise."""
    import torch

    vocab = model.cfg.vocab_size
    gen = torch.Generator().manual_seed(batch * 100_003 + prompt)
    tokens = torch.randint(0, vocab, (batch, prompt), generator=gen).to(device)
    new = torch.randint(0, vocab, (batch, steps), generator=gen).to(device)
    cuda = device.type == "cuda"

    def now() -> tuple[float, float]:
        if cuda:
            torch.cuda.synchronize()
            wall = time.perf_counter()
            return wall, wall
        return time.thread_time(), time.perf_counter()

    got: dict[str, list] = {"prefill": [], "decode": [], "prefill_wall": [], "decode_wall": []}
    with torch.inference_mode():
        for rep in range(repeats + 1):  # the first is the warm-up
            t0 = now()
            _, cache = model.prefill(tokens, capacity=prompt + steps)
            t1 = now()
            stamps = [t1]
            for t in range(steps):
                model.decode_step(new[:, t], cache)
                stamps.append(now())
            if rep:
                for c, key in ((0, ""), (1, "_wall")):
                    got["prefill" + key].append(t1[c] - t0[c])
                    got["decode" + key].append([b[c] - a[c] for a, b in itertools.pairwise(stamps)])
    return got


def count_ops(model, batch: int, prompt: int) -> dict:
    """The ops eager PyTorch dispatches (aten calls, views included) in one prefill of
    ``batch`` x ``prompt`` tokens and one decode step after it, in the layers and outside."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    layers = len(model.layers)
    tokens = torch.zeros((batch, prompt), dtype=torch.long, device=model.rope_cos.device)
    out = {}
    with torch.inference_mode():
        for kind in ("prefill", "decode"):
            per = []
            for n in (1, 2):  # the layers' ops from the difference of 1 and 2 layers
                keep = dict(model.layers)
                model.layers = torch.nn.ModuleDict({k: keep[k] for k in list(keep)[:n]})
                _, cache = model.prefill(tokens, capacity=prompt + 1)
                Count.n = 0
                with Count():
                    if kind == "prefill":
                        model.prefill(tokens, capacity=prompt + 1)
                    else:
                        model.decode_step(tokens[:, 0], cache)
                per.append(Count.n)
                model.layers = torch.nn.ModuleDict(keep)
            out[kind] = {"per_layer": per[1] - per[0], "outside": 2 * per[0] - per[1]}
    out["layers"] = layers
    return out


def host_op_s(repeats: int = 50) -> float:
    """This host's time for one eager op: a one-layer model too small for its arithmetic to
    count (dim 8, vocabulary 8), its decode step's time over the ops it dispatches."""
    import torch

    from aihpc.runtime import Llama, LlamaConfig

    cfg = LlamaConfig(
        dim=8, num_layers=1, num_heads=2, num_kv_heads=1, ffn_dim=8, vocab_size=8, max_seq_len=64
    )
    model = Llama(cfg)
    model.init_weights(0)
    model.eval()
    ops = count_ops(model, 1, 4)
    n = ops["decode"]["per_layer"] + ops["decode"]["outside"]
    tok = torch.zeros((1, 4), dtype=torch.long)
    times = []
    with torch.inference_mode():
        _, cache = model.prefill(tok, capacity=4 + repeats + 5)
        for _ in range(repeats + 5):
            t0 = time.perf_counter()
            model.decode_step(tok[:, 0], cache)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[5:]) / n


def storage_dtype(gpu: bool) -> str:
    """The dtype the estimate stores weights and KV in: the run's own (bf16 on a GPU, fp32 on
    a CPU) where the estimate knows it, else bf16 (said in the results: ``priced_dtype``)."""
    from aihpc.perf.infer.kv import DTYPE_BYTES, KV_DTYPES

    if gpu or "fp32" not in DTYPE_BYTES or "fp32" not in KV_DTYPES:
        return "bf16"
    return "fp32"


def linear_rates(model, repeats: int = 3) -> dict:
    """What the model's own linears reach on this thread's CPU clock, one after the other as a
    forward runs them, medians of ``repeats``: at one row, a decode step's weights streamed from
    memory (bytes over time, GB/s); at 16-1024 rows, (GFLOP of one call, TFLOP/s) points of a
    GEMM curve (a calibration's ``[[gemm]] points``, but timed on the CPU clock): as measured
    (``gemm_points_measured``) and with the weights' streaming at the one-row rate taken out
    (``gemm_points``: the arithmetic alone, which the estimate adds to the streaming on a CPU
    host, where one core does both)."""
    import torch
    import torch.nn.functional as F

    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    out: dict = {"weight_bytes": nbytes, "gemm_points": [], "gemm_points_measured": []}
    with torch.inference_mode():
        for rows in (1, 16, 64, 256, 1024):
            xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
            times = []
            for _ in range(repeats + 1):
                t0 = time.thread_time()
                for w in weights:
                    F.linear(xs[w.shape[1]], w)
                times.append(time.thread_time() - t0)
            t = statistics.median(times[1:])
            flops = sum(2.0 * rows * w.numel() for w in weights)
            gflop = flops / len(weights) / 1e9
            if rows == 1:
                out["decode_weight_GBps"] = nbytes / t / 1e9
                stream_s = t
            else:
                out["gemm_points_measured"].append((gflop, flops / t / 1e12))
                out["gemm_points"].append((gflop, flops / max(t - stream_s, 0.05 * t) / 1e12))
    return out


def attention_rates(model, tokens: int = 1024, repeats: int = 3) -> dict:
    """The model's causal attention call (SDPA at its heads, KV heads and head dim, one
    sequence) at ``tokens`` and half as many on this thread's CPU clock, TFLOP/s counted as the
    estimate counts them (the causal half of 4 s^2 d per head), medians of ``repeats``: the
    same measurement `calibrate --local` makes on the wall clock."""
    import torch
    import torch.nn.functional as F

    cfg = model.cfg
    heads, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.dim // cfg.num_heads
    out = {}
    with torch.inference_mode():
        for s in (tokens, tokens // 2):
            q, k, v = (torch.randn(1, n, s, d) for n in (heads, kv, kv))
            times = []
            for _ in range(repeats + 1):
                t0 = time.thread_time()
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != heads)
                times.append(time.thread_time() - t0)
            out[s] = 4 * s * s * heads * d * 0.5 / statistics.median(times[1:]) / 1e12
    return {"tokens": tokens, "tflops": out[tokens], "tflops_half": out[tokens // 2]}


def host_cluster(spec, host: dict):
    """The calibrated cluster with the benchmark's own calibration step on the CPU clock (the
    clock it times the model on): the GEMM curve of the model's own linears, the rate a
    decode step's matrix-vector products stream weights at (``weight_stream_GBps``) and the
    model's attention call's rate and fall-off; the spec's copy bandwidth stays what KV and
    activations move at."""
    import dataclasses

    from aihpc.bench.local import half_tokens
    from aihpc.runspec.calibration import Calibration, GemmFit

    lin, att = host["linears"], host["attention"]
    peak = spec.cluster.gpu.sustained_peak_tflops("bf16")
    gpu = dataclasses.replace(
        spec.cluster.gpu,
        weight_stream_GBps=lin["decode_weight_GBps"],
        host_op_us=host["op_s"] * 1e6,
        attention_fwd_efficiency=min(1.0, att["tflops"] / peak),
        attention_tokens=att["tokens"],
        attention_half_fwd_tokens=half_tokens(att["tflops"], att["tflops_half"], att["tokens"]),
    )
    points = tuple(sorted(tuple(p) for p in lin["gemm_points"]))
    cal = spec.cluster.calibration or Calibration()
    cal = dataclasses.replace(cal, gemm={p: GemmFit(p, points) for p in ("bf16", "fp32")})
    return dataclasses.replace(spec.cluster, gpu=gpu, calibration=cal)


def host_params(host: dict):
    """The model's constants with this host's measured time of one eager CPU op."""
    import dataclasses

    from aihpc.perf.step.params import DEFAULT_PARAMS

    return dataclasses.replace(DEFAULT_PARAMS, host_cpu_op_s=host["op_s"])


def predict(spec, batch: int, prompt: int, output: int, gpu: bool, cluster=None, params=None):
    from aihpc.perf.infer import estimate_inference

    dtype = storage_dtype(gpu)
    return estimate_inference(
        spec.model, cluster or spec.cluster, batch=batch, prompt_len=prompt, output_len=output,
        act_dtype="bf16" if gpu else "fp32", weight_dtype=dtype, kv_dtype=dtype, params=params,
    )  # fmt: skip


def rows_for(spec, args: argparse.Namespace, device) -> tuple[list[dict], dict | None]:
    import torch

    torch.manual_seed(0)
    model = build_model(spec, device)
    host = None
    if not args.gpu:  # the calibration step on the CPU clock (see the module's docstring)
        ops = count_ops(model, 1, 8)
        host = {"ops": ops, "op_s": host_op_s(), "linears": linear_rates(model)}
        host["attention"] = attention_rates(model, min(1024, spec.model.seq_length))
        cpu, cpu_params = host_cluster(spec, host), host_params(host)
        print(
            f"eager ops: {ops['decode']['per_layer']} a layer and {ops['decode']['outside']} "
            f"outside in a decode step, {ops['prefill']['per_layer']} and "
            f"{ops['prefill']['outside']} in a prefill; {host['op_s'] * 1e6:.1f} us an op; "
            f"the linears: {host['linears']['decode_weight_GBps']:.1f} GB/s of weights at one "
            f"row, {host['linears']['gemm_points'][-1][1]:.3f} TFLOP/s at 1024",
            flush=True,
        )
    rows = []
    steps = max(args.outputs) - 1
    for batch in args.batches:
        for prompt in args.prompts:
            got = measure(model, batch, prompt, steps, args.repeats, device)
            est = predict(spec, batch, prompt, max(args.outputs), args.gpu)
            wall = got["prefill_wall"]
            rows.append(row("prefill", batch, prompt, None, got["prefill"], wall, est.prefill))
            for out in args.outputs:
                per_rep = [statistics.fmean(d[: out - 1]) for d in got["decode"]]
                wall = [statistics.fmean(d[: out - 1]) for d in got["decode_wall"]]
                est = predict(spec, batch, prompt, out, args.gpu)
                rows.append(row("decode step", batch, prompt, out, per_rep, wall, est.decode))
            first = rows[-len(args.outputs) - 1]
            if host is not None:
                for r in rows[-len(args.outputs) - 1 :]:
                    est = predict(spec, batch, prompt, r["output"] or 2, False, cpu, cpu_params)
                    with_host(r, est)
            print(
                f"batch {batch}, prompt {prompt}: prefill {first['measured_s'] * 1e3:.1f} ms "
                f"(predicted {first['predicted_s'] * 1e3:.1f}), decode step "
                f"{rows[-1]['measured_s'] * 1e3:.2f} ms (predicted "
                f"{rows[-1]['predicted_s'] * 1e3:.2f})",
                flush=True,
            )
    return rows, host


def row(kind: str, batch: int, prompt: int, output: int | None, times: list, wall: list, step):
    med = statistics.median(times)
    return {
        "kind": kind,
        "batch": batch,
        "prompt": prompt,
        "output": output,
        "measured_s": med,
        "fastest_s": min(times),
        "wall_s": statistics.median(wall),
        "predicted_s": step.total,
        "error": step.total / med - 1,
        "terms_s": step.to_json(),
    }


def with_host(r: dict, est) -> None:
    """The estimate with the benchmark's calibration step (``host_cluster``, ``host_params``)."""
    step = est.prefill if r["kind"] == "prefill" else est.decode
    r["predicted_with_host_s"] = step.total
    r["error_with_host"] = step.total / r["measured_s"] - 1
    r["terms_with_host_s"] = step.to_json()


def summary(rows: list[dict], key: str = "predicted_s") -> dict:
    """Median |error|, the worst row and Spearman's rho of the prediction ``key``, over all
    rows and per kind."""
    out = {}
    for name, part in (
        ("all", rows),
        ("prefill", [r for r in rows if r["kind"] == "prefill"]),
        ("decode", [r for r in rows if r["kind"] == "decode step"]),
    ):
        part = [r for r in part if key in r]
        if not part:
            continue
        errs = [abs(r[key] / r["measured_s"] - 1) for r in part]
        rho = None
        if len(part) > 2:
            rho = spearman([r["measured_s"] for r in part], [r[key] for r in part])
        out[name] = {"median_abs_error": statistics.median(errs), "worst": max(errs), "rho": rho}
    return out


def table(rows: list[dict], stats: dict, host_stats: dict) -> str:
    host = bool(host_stats)
    lines = [
        "| kind | batch | prompt | output | measured ms | wall ms | predicted ms | error |"
        + (" CPU-clock calibration ms | error |" if host else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if host else ""),
    ]
    for r in rows:
        out = "" if r["output"] is None else str(r["output"])
        line = (
            f"| {r['kind']} | {r['batch']} | {r['prompt']} | {out} | {r['measured_s'] * 1e3:.2f} "
            f"| {r['wall_s'] * 1e3:.2f} | {r['predicted_s'] * 1e3:.2f} | {r['error']:+.0%} |"
        )
        if host:
            line += f" {r['predicted_with_host_s'] * 1e3:.2f} | {r['error_with_host']:+.0%} |"
        lines.append(line)
    lines.append("")
    titles = (("estimate, spec alone", stats), ("estimate, CPU-clock calibration", host_stats))
    for title, table_stats in titles:
        for name, s in table_stats.items():
            rho = "-" if s["rho"] is None else f"{s['rho']:.2f}"
            lines.append(
                f"{title}, {name}: median |error| {s['median_abs_error']:.0%} (target <= 20%), "
                f"worst {s['worst']:.0%}, Spearman rho {rho}"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompts", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--outputs", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--repeats", type=int, default=3, help="measured runs after one warm-up")
    ap.add_argument("--spec", type=Path, help="a host copy `aihpc calibrate --local` wrote")
    ap.add_argument("--tiny", action="store_true", help="the 2-layer test model (a smoke run)")
    ap.add_argument("--gpu", action="store_true", help="on this machine's GPU, bf16")
    ap.add_argument("--name", help="results name (default: inference_vs_measured[_gpu])")
    add_results_arg(ap)
    args = ap.parse_args()
    bad = [
        (f"--{name}", v)
        for name in ("batches", "prompts", "outputs")
        for v in getattr(args, name)
        if v < 1 + (name == "outputs")
    ]
    if bad or args.repeats < 1:
        field, value = bad[0] if bad else ("--repeats", args.repeats)
        print(f"{field} {value}: must be a whole number >= 1 (outputs >= 2)", file=sys.stderr)
        raise SystemExit(2)
    import torch

    if args.gpu and not torch.cuda.is_available():
        print("--gpu: no CUDA GPU visible", file=sys.stderr)
        raise SystemExit(2)
    device = torch.device("cuda" if args.gpu else "cpu")
    if not args.gpu:
        torch.set_num_threads(1)
    model = GPU_MODEL if args.gpu else TINY_MODEL if args.tiny else MODEL
    with tempfile.TemporaryDirectory(prefix="aihpc-ivm-") as tmp:
        spec = host_spec(args, Path(tmp), model)
    longest = max(args.prompts) + max(args.outputs) - 1
    if longest > spec.model.seq_length:
        print(
            f"--prompts/--outputs: the longest sequence {longest} exceeds the model's "
            f"seq_length {spec.model.seq_length}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    rows, host = rows_for(spec, args, device)
    stats, host_stats = summary(rows), summary(rows, "predicted_with_host_s")
    data = {
        "machine": machine(),
        "device": torch.cuda.get_device_name() if args.gpu else "cpu, 1 thread",
        "gpu_spec": {k: v for k, v in vars(spec.cluster.gpu).items() if v is not None},
        "calibration_gemm_points": {
            k: g.points for k, g in getattr(spec.cluster.calibration, "gemm", {}).items()
        },
        "repeats": args.repeats,
        "priced_dtype": {
            "activations": "bf16" if args.gpu else "fp32",
            "weights_kv": storage_dtype(args.gpu),
        },
        "rows": rows,
        "summary": stats,
        "host": host,
        "summary_with_host": host_stats,
    }
    name = args.name or ("inference_vs_measured_gpu" if args.gpu else "inference_vs_measured")
    save(name, data, table(rows, stats, host_stats), args.results)


if __name__ == "__main__":
    main()
