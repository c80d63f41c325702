"""The routed experts' GEMMs of the small-expert MoE validation rows, measured against the model.

    python benchmarks/moe_expert_gemms.py [--results DIR]          # needs a CUDA GPU
    python benchmarks/moe_expert_gemms.py --model-only [--results DIR]

The MoE development set's worst rows (moe_runs.csv: H08, H13 GPT-OSS-120B, H09 Qwen3-30B-A3B,
H12 Qwen3-235B-A22B) run eager Megatron-Core layers whose routed experts are one GEMM launch per
local expert (Transformer Engine's GroupedLinear, ``moe_expert_gemm = per_expert``), with 8 or 16
local experts and 1,024-4,096 rows each; the model prices them 37-54% fast. This times, for each
row's shape on one GPU, what the model prices one layer's routed experts at:

- the per-expert loop as the row runs it, forward (fc1 then fc2) and backward (input and weight
  gradient of each), on one stream, in the row's precision (FP8: each expert's input cast to e4m3
  with its own amax before its ``torch._scaled_mm``, as current scaling does), timed twice: as
  issued from Python (where the host is slower than the kernels, the host's time: the FP8 casts
  here are Python ops, where Transformer Engine issues them from C++) and queued behind a GPU
  sleep (the GPU's own time, which is what the model prices);
- the same products as one ``torch._grouped_mm`` per projection (BF16; where torch has it);
- the host's issue time per expert GEMM of the loop (with its casts), the GPU kept busy so the
  host never waits.

Beside each, the model's figure (perf/step/gemm.py ``gemm_time_s`` and perf/step/moe_kernels.py
``expert_gemm_time_s`` at the rows per expert the plan gives). Where the loop measures well above
the model, the experts' GEMMs are the miss; where the loop matches and the host's issue time per
GEMM is well above what perf/step/moe_host.py prices (``kernel_overhead_s`` a launch, plus
``host_eager_op_s`` per Python-issued op under FP8), the miss is the eager host.
``--model-only`` prints the model's side alone (no GPU needed). Writes moe_expert_gemms.json/.md.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from typing import Any

from _common import add_results_arg, catalog_gpu, machine, save

from aihpc.perf.fit.runs_csv import row_runspec
from aihpc.perf.fit.validate import data_file
from aihpc.perf.step.gemm import gemm_bwd_s, gemm_time_s
from aihpc.perf.step.moe_kernels import expert_gemm_time_s, routed_tokens
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec.cluster import gpu_from_id

ROWS = ("H08", "H09", "H12", "H13")


def shapes(row_id: str, csv_name: str = "moe_runs.csv") -> dict[str, Any]:
    """One MoE layer's routed-expert products on the busiest GPU of the row's plan."""
    with open(data_file(csv_name), newline="") as f:
        row = next(r for r in csv.DictReader(f) if r["id"] == row_id)
    spec = row_runspec(row)
    model, plan, training = spec.model, spec.plan(), spec.training
    h, ffn = model.hidden_size, model.expert_ffn_hidden_size
    f_in = 2 * ffn if model.ffn_activation == "swiglu" else ffn
    local = model.num_experts // plan.ep
    rows = round(routed_tokens(model, plan, training) / local)
    return {
        "id": row_id,
        "model": model.name,
        "gpu": spec.cluster.gpu.name,
        "precision": training.precision,
        "how": training.moe_expert_gemm,
        "local_experts": local,
        "rows_per_expert": rows,
        # (rows, n, k) of fc1 and fc2: out[rows, n] = x[rows, k] @ W[k, n]
        "projections": [(rows, f_in // plan.etp, h), (rows, h, ffn // plan.etp)],
        "spec": spec,
    }


def model_ms(s: dict[str, Any], gpu_id: str | None = None) -> tuple[float, float]:
    """(forward, backward) ms the model gives the layer's routed-expert GEMMs on the row's own
    GPU, or on the catalog part ``gpu_id`` (the GPU a measurement ran on)."""
    spec, p = s["spec"], DEFAULT_PARAMS
    gpu = spec.cluster.gpu if gpu_id is None else gpu_from_id(gpu_id)
    prec = s["precision"]

    def experts(m: float, n: float, k: float) -> float:
        one = gemm_time_s(m, n, k, gpu, prec, p)
        return expert_gemm_time_s(one, s["local_experts"], prec, p, s["how"])

    fwd = sum(experts(*x) for x in s["projections"])
    bwd = sum(gemm_bwd_s(experts, *x) for x in s["projections"])
    return fwd * 1e3, bwd * 1e3


def _cast(t):
    """An FP8 (e4m3) copy of a 2-D operand with its own amax scale: (copy, float32 scale)."""
    import torch

    scale = t.abs().amax().float().clamp(min=1e-12) / 448.0
    return (t / scale).to(torch.float8_e4m3fn), scale


def layer_fns(projections: list[tuple[int, int, int]], local: int, fp8: bool, device: str):
    """(forward, backward, grouped forward or None) of the local experts' products of each
    projection, one launch per expert; each returns its outputs. FP8: the activation or
    gradient operand is cast per expert and call with its own amax (current scaling), the
    other operand's FP8 copy is made once (the weight's, and the forward input's transposed
    copy Transformer Engine keeps for the weight gradient)."""
    import torch

    bf16 = torch.bfloat16

    def mm(a, b):  # b: (k, n) as a bf16 view, or an (FP8 column-major copy, scale) pair
        if not fp8:
            return a @ b
        a8, sa = _cast(a)
        b8, sb = b
        return torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=bf16)

    def keep(b):  # the kept operand: FP8 column-major copy with its scale, or the bf16 view
        if not fp8:
            return b
        b8, sb = _cast(b.t().contiguous())
        return b8.t(), sb

    ops = []
    for m, n, k in projections:
        x = [torch.randn(m, k, device=device, dtype=bf16) for _ in range(local)]
        w = [torch.randn(n, k, device=device, dtype=bf16) / k**0.5 for _ in range(local)]
        dy = [torch.randn(m, n, device=device, dtype=bf16) for _ in range(local)]
        fwd_b = [keep(we.t()) for we in w]
        dgrad_b = [keep(we) for we in w]
        wgrad_b = [keep(xe) for xe in x]
        ops.append((x, dy, fwd_b, dgrad_b, wgrad_b, w))

    def fwd() -> list:
        return [mm(xe, b) for x, _, fb, _, _, _ in ops for xe, b in zip(x, fb, strict=True)]

    def bwd() -> list:
        out = []
        for _, dy, _, db, wb, _ in ops:
            for de, b_d, b_w in zip(dy, db, wb, strict=True):
                if not fp8:
                    out.append(de @ b_d)  # input gradient, contracts over n
                    out.append(de.t() @ b_w)  # weight gradient, contracts over the rows
                    continue
                # the gradient cast once per expert, its row-major transpose for the weight
                # gradient made from the FP8 copy (cuBLASLt takes FP8 A row-major only;
                # Transformer Engine's cast writes both copies in one kernel)
                d8, sd = _cast(de)
                for a8, (b8, sb) in ((d8, b_d), (d8.t().contiguous(), b_w)):
                    out.append(torch._scaled_mm(a8, b8, scale_a=sd, scale_b=sb, out_dtype=bf16))
        return out

    if fp8 or not hasattr(torch, "_grouped_mm"):
        return fwd, bwd, None
    grouped = []
    for x, _, _, _, _, w in ops:
        rows = torch.arange(1, local + 1, device=device, dtype=torch.int32) * x[0].shape[0]
        grouped.append((torch.cat(x), torch.stack([we.t() for we in w]), rows))

    def grouped_fwd() -> list:
        return [torch._grouped_mm(xs, ws, offs=offs, out_dtype=bf16) for xs, ws, offs in grouped]

    return fwd, bwd, grouped_fwd


def _timed_ms(fn, repeats: int = 7, queued: bool = False) -> float:
    """Median ms between CUDA events around ``fn``: as issued (the GPU runs each kernel when
    the host has issued it, so a host slower than the kernels sets the time), or ``queued``:
    behind a GPU sleep long enough for the host to issue every kernel first, so the events
    time the GPU's own work."""
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        if queued:
            torch.cuda._sleep(400_000_000)  # ~0.2 s at 2 GHz: longer than any layer's issue
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def _host_us_per_gemm(fn, gemms: int) -> float:
    """CPU microseconds to issue ``fn`` per expert GEMM (with its casts), the GPU kept busy
    meanwhile so that the host never waits on it."""
    import torch

    samples = []
    for _ in range(5):
        torch.cuda._sleep(200_000_000)
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6 / gemms)
        torch.cuda.synchronize()
    return statistics.median(samples)


def measure(s: dict[str, Any]) -> dict[str, Any]:
    import torch

    local = s["local_experts"]
    fwd, bwd, grouped = layer_fns(s["projections"], local, s["precision"] == "fp8", "cuda")
    out = {"loop_fwd_ms": _timed_ms(fwd), "loop_bwd_ms": _timed_ms(bwd)}
    out["loop_fwd_gpu_ms"] = _timed_ms(fwd, queued=True)
    out["loop_bwd_gpu_ms"] = _timed_ms(bwd, queued=True)
    out["host_us_per_gemm"] = _host_us_per_gemm(fwd, len(s["projections"]) * local)
    if grouped is not None:
        try:
            out["grouped_fwd_ms"] = _timed_ms(grouped)
        except (RuntimeError, TypeError) as exc:  # not on this GPU / torch build
            out["grouped_error"] = str(exc).splitlines()[0]
    torch.cuda.empty_cache()
    return out


def table(results: list[dict[str, Any]], measured: bool) -> str:
    head = (
        "| row | model | precision | local experts | rows / expert | model fwd ms | model bwd ms |"
    )
    sep = "|---|---|---|---:|---:|---:|---:|"
    if measured:
        head += (
            " model here fwd / bwd ms | loop fwd / bwd ms as issued | loop fwd / bwd ms GPU |"
            " loop GPU / model here (fwd+bwd) |"
            " grouped fwd ms | host µs / GEMM |"
        )
        sep += "---:|---:|---:|---:|---:|---:|"
    lines = [head, sep]
    for r in results:
        line = (
            f"| {r['id']} | {r['model']} | {r['precision']} | {r['local_experts']} | "
            f"{r['rows_per_expert']:,} | {r['model_fwd_ms']:.3f} | {r['model_bwd_ms']:.3f} |"
        )
        if measured:
            g = r.get("grouped_fwd_ms")
            here = r["here_fwd_ms"] + r["here_bwd_ms"]
            line += (
                f" {r['here_fwd_ms']:.3f} / {r['here_bwd_ms']:.3f} |"
                f" {r['loop_fwd_ms']:.3f} / {r['loop_bwd_ms']:.3f} |"
                f" {r['loop_fwd_gpu_ms']:.3f} / {r['loop_bwd_gpu_ms']:.3f} |"
                f" {(r['loop_fwd_gpu_ms'] + r['loop_bwd_gpu_ms']) / here:.2f} |"
                f" {'n/a' if g is None else f'{g:.3f}'} | {r['host_us_per_gemm']:.1f} |"
            )
        lines.append(line)
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_results_arg(ap)
    ap.add_argument("--model-only", action="store_true", help="the model's figures alone")
    ap.add_argument("--csv", default="moe_runs.csv", help="validation file of the rows")
    ap.add_argument("--rows", nargs="+", default=list(ROWS), help="row ids in that file")
    ap.add_argument("--name", default="moe_expert_gemms", help="results file name")
    args = ap.parse_args()
    measured = not args.model_only
    if measured:
        import torch

        if not torch.cuda.is_available():
            print("moe_expert_gemms.py needs a CUDA GPU (or --model-only)", file=sys.stderr)
            return 2
    here_gpu = catalog_gpu() if measured else None
    results = []
    for row_id in args.rows:
        s = shapes(row_id, args.csv)
        fwd, bwd = model_ms(s)
        r = {k: v for k, v in s.items() if k != "spec"}
        r.update(model_fwd_ms=fwd, model_bwd_ms=bwd)
        if measured:
            here = model_ms(s, here_gpu)
            r.update(here_gpu=here_gpu, here_fwd_ms=here[0], here_bwd_ms=here[1])
            r.update(measure(s))
        results.append(r)
    data: dict[str, Any] = {"machine": machine(), "rows": results}
    if measured:
        import torch

        data["device"] = torch.cuda.get_device_name()
    note = (
        "Model fwd/bwd: each row's own GPU. Measured columns: the GPU this ran on "
        f"({data.get('device', 'none: --model-only')}); 'model here': the same GEMMs priced "
        f"for that GPU's catalog entry ({here_gpu}), the figure to compare them with."
    )
    save(args.name, data, table(results, measured) + "\n\n" + note, args.results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
