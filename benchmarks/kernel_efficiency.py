"""Measured kernel efficiencies on a GPU, for the performance model's compute constants.

    python benchmarks/kernel_efficiency.py [--results DIR | --out DIR/kernel_efficiency_<gpu>]
    python benchmarks/kernel_efficiency.py --backward [--results DIR]   # a linear's three GEMMs

Times, with CUDA events, (1) the GEMMs of the validation models' layers at 4K, 16K and 64K
tokens plus cubes, in bf16 and in fp8 (``torch._scaled_mm``, e4m3, per-tensor scales, bf16
output), and (2) causal and rectangular (ring-attention block) attention, forward and
forward+backward, through PyTorch SDPA's flash (FlashAttention-2), cuDNN and memory-efficient
backends, head dim 128, 32 heads. Attention FLOPs are the executed ones (causal halved; the
backward counted as 2.5x the forward). Each figure is the median of timed repeats after warm-up.
Prints a table and writes <out>.json and <out>.md. Needs a CUDA GPU.

``--backward`` times instead the three GEMMs of one linear layer as training runs them, for the
shapes whose contraction lengths differ most: the forward x[M, K] @ W^T (contracts over K), the
input gradient dY[M, N] @ W (over N) and the weight gradient dY^T @ x (over the M tokens); in
FP8 with the transposed copies Transformer Engine keeps for the backward. The model prices each
at its own K on the curve fitted to the forward GEMMs (``gemm_half_k``); this measures whether
the input and weight gradients follow it (written to <out>_backward.json / .md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import add_results_arg
from torch.nn.attention import SDPBackend, sdpa_kernel

# (name, N, K) of each layer GEMM: out = x[M, K] @ W[K, N]
LAYER_GEMMS = {
    "llama3-8b": [
        ("qkv", 6144, 4096),
        ("o", 4096, 4096),
        ("w13", 28672, 4096),
        ("w2", 4096, 14336),
    ],
    "llama3-70b/tp8": [
        ("qkv", 1280, 8192),
        ("o", 8192, 1024),
        ("w13", 7168, 8192),
        ("w2", 8192, 3584),
    ],
    # torchtitan's TP plan runs q, k, v and w1, w3 as separate linears: at TP 8 an 8B layer has
    # 128-wide K and V projections and 512-wide reductions (held-out T5-T8 miss by +15-31%).
    "llama3-8b/tp8": [
        ("q", 512, 4096),
        ("k", 128, 4096),
        ("o", 4096, 512),
        ("w1", 1792, 4096),
        ("w2", 4096, 1792),
    ],
    "mcore-1.7b": [
        ("qkv", 6144, 2048),
        ("proj", 2048, 2048),
        ("fc1", 8192, 2048),
        ("fc2", 2048, 8192),
    ],
    "gpt3-175b/tp8": [
        ("qkv", 4608, 12288),
        ("proj", 12288, 1536),
        ("fc1", 6144, 12288),
        ("fc2", 12288, 6144),
    ],
}
TOKENS = (4096, 16384, 65536)
CUBES = (1024, 2048, 4096, 8192, 16384)
OUTPUT = [("llama3-8b logits", 128256, 4096), ("mcore-1.7b logits", 131072, 2048)]


def timed(fn, warmup: int = 3, min_ms: float = 30.0, repeats: int = 5) -> float:
    """Median seconds per call; each repeat runs enough calls to last min_ms."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    calls = max(1, int(min_ms / max(start.elapsed_time(end), 1e-3)))
    samples = []
    for _ in range(repeats):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(samples)


def gemm_cases() -> list[tuple[str, int, int, int]]:
    cases = []
    for model, gemms in LAYER_GEMMS.items():
        for m in TOKENS:
            cases += [(f"{model} {name}", m, n, k) for name, n, k in gemms]
    cases += [(name, 16384, n, k) for name, n, k in OUTPUT]
    cases += [(f"cube {c}", c, c, c) for c in CUBES]
    return cases


def run_gemm(name: str, m: int, n: int, k: int, precision: str) -> dict:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    if precision == "bf16":
        bt = b.t()

        def fn():
            return a @ bt
    else:
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.to(torch.float8_e4m3fn).t()  # column-major second operand, as _scaled_mm needs
        one = torch.ones((), device="cuda")

        def fn():
            return torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    sec = timed(fn)
    flop = 2.0 * m * n * k
    return {
        "case": name,
        "precision": precision,
        "m": m,
        "n": n,
        "k": k,
        "gflop": flop / 1e9,
        "us": sec * 1e6,
        "tflops": flop / sec / 1e12,
    }


# (case, M tokens, N, K) of forward GEMMs whose backward contracts over very different lengths
BACKWARD_CASES = [
    ("llama3-8b/tp8 o", 16384, 4096, 512),
    ("llama3-70b/tp8 o", 16384, 8192, 1024),
    ("llama3-8b qkv", 16384, 6144, 4096),
    ("llama3-8b w2", 16384, 4096, 14336),
    ("llama3-8b w13", 8192, 28672, 4096),
    ("gpt3-175b/tp8 fc1", 4096, 6144, 12288),
]


def _mm(a: torch.Tensor, b: torch.Tensor, precision: str):
    """a @ b in bf16, or in FP8 as a TE GEMM runs it: e4m3 operands, per-tensor scales, a
    row-major first and a column-major second operand (the copies a cast-transpose keeps)."""
    if precision == "bf16":
        return lambda: a @ b
    a8 = a.to(torch.float8_e4m3fn).contiguous()
    b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    return lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def run_linear_backward(name: str, m: int, n: int, k: int, precision: str) -> list[dict]:
    """Forward, input-gradient and weight-gradient GEMMs of a linear x[M, K] -> y[M, N]."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    out = []
    for gemm, a, b, contract in (
        ("fwd", x, w.t(), k),
        ("dgrad", dy, w, n),
        ("wgrad", dy.t(), x, m),
    ):
        sec = timed(_mm(a, b, precision))
        flop = 2.0 * m * n * k
        out.append(
            {
                "case": name,
                "gemm": gemm,
                "precision": precision,
                "m": m,
                "n": n,
                "k": k,
                "contraction": contract,
                "us": sec * 1e6,
                "tflops": flop / sec / 1e12,
            }
        )
    return out


def backward_main(out: Path, gpu: str) -> int:
    rows = []
    for prec in ("bf16", "fp8"):
        for name, m, n, k in BACKWARD_CASES:
            for r in run_linear_backward(name, m, n, k, prec):
                rows.append(r)
                print(
                    f"{prec:4s} {name:20s} {r['gemm']:5s} K={r['contraction']:6d} "
                    f"{r['tflops']:8.1f} TF/s",
                    flush=True,
                )
            torch.cuda.empty_cache()
    doc = {"gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda, "linear": rows}
    lines = [
        f"# A linear's forward, input-gradient and weight-gradient GEMMs on {gpu}",
        "",
        "| precision | case | M x N x K | GEMM | contracts over | TFLOP/s |",
        "|---|---|---|---|---:|---:|",
    ]
    lines += [
        f"| {r['precision']} | {r['case']} | {r['m']}x{r['n']}x{r['k']} | {r['gemm']} | "
        f"{r['contraction']} | {r['tflops']:.1f} |"
        for r in rows
    ]
    _write(out.with_name(out.name + "_backward"), doc, lines)
    return 0


def _write(path: Path, doc: dict, lines: list[str]) -> None:
    """<path>.json (the measurements) and <path>.md (the table)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {path}.json and .md")


def run_attention(backend: str, b: int, sq: int, skv: int, causal: bool, heads=32, d=128) -> dict:
    q = torch.randn(b, heads, sq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, heads, skv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, heads, skv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(b, heads, sq, d, device="cuda", dtype=torch.bfloat16)
    kind = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }[backend]
    flop_f = 4.0 * b * heads * sq * skv * d * (0.5 if causal else 1.0)
    out = {"backend": backend, "batch": b, "sq": sq, "skv": skv, "causal": causal}
    try:
        with sdpa_kernel([kind]):

            def fwd():
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            def fwd_bwd():
                o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                o.backward(grad)

            tf = timed(fwd, min_ms=20.0, repeats=3)
            tfb = timed(fwd_bwd, min_ms=20.0, repeats=3)
    except RuntimeError as exc:  # backend unavailable for this shape or build
        return {**out, "error": str(exc).splitlines()[0][:200]}
    tb = max(tfb - tf, 1e-9)
    out.update(
        fwd_ms=tf * 1e3,
        bwd_ms=tb * 1e3,
        fwd_tflops=flop_f / tf / 1e12,
        bwd_tflops=2.5 * flop_f / tb / 1e12,
    )
    return out


def attention_cases() -> list[tuple[int, int, int, bool]]:
    cases = [(max(1, 32768 // s), s, s, True) for s in (2048, 4096, 8192, 16384, 32768, 65536)]
    # load-balanced ring-attention blocks at 32K tokens per rank: q x half the kv, non-causal
    cases += [(1, 32768, 16384, False), (1, 16384, 32768, False), (1, 32768, 32768, False)]
    return cases


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", type=Path, default=None, help="output path without suffix (default: in --results)"
    )
    add_results_arg(ap)
    ap.add_argument("--quick", action="store_true", help="fewer cases (a smoke run)")
    ap.add_argument(
        "--backward",
        action="store_true",
        help="time a linear's forward, input-gradient and weight-gradient GEMMs instead",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("kernel_efficiency.py needs a CUDA GPU", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name()
    tag = gpu.lower().replace("nvidia ", "").replace(" ", "-")
    out = args.out or args.results / f"kernel_efficiency_{tag}"
    if args.backward:
        return backward_main(out, gpu)
    doc = {
        "gpu": gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "gemm": [],
        "attention": [],
    }
    gcases = gemm_cases()[:6] if args.quick else gemm_cases()
    for prec in ("bf16", "fp8"):
        for name, m, n, k in gcases:
            r = run_gemm(name, m, n, k, prec)
            doc["gemm"].append(r)
            print(
                f"gemm {prec:4s} {name:24s} {m:6d}x{n:6d}x{k:6d} {r['tflops']:8.1f} TF/s",
                flush=True,
            )
    acases = attention_cases()[:2] if args.quick else attention_cases()
    for backend in ("flash", "cudnn", "efficient"):
        for b, sq, skv, causal in acases:
            r = run_attention(backend, b, sq, skv, causal)
            doc["attention"].append(r)
            if "error" in r:
                print(f"attn {backend:9s} {sq}x{skv} causal={causal}: {r['error']}", flush=True)
            else:
                print(
                    f"attn {backend:9s} b{b} {sq:6d}x{skv:6d} causal={causal!s:5s} "
                    f"fwd {r['fwd_tflops']:6.1f} bwd {r['bwd_tflops']:6.1f} TF/s",
                    flush=True,
                )
            torch.cuda.empty_cache()
    lines = [
        f"# Kernel efficiency on {gpu} (torch {torch.__version__}, CUDA {torch.version.cuda})",
        "",
        "| precision | case | M x N x K | GFLOP | TFLOP/s |",
        "|---|---|---|---:|---:|",
    ]
    lines += [
        f"| {r['precision']} | {r['case']} | {r['m']}x{r['n']}x{r['k']} | {r['gflop']:.1f} | "
        f"{r['tflops']:.1f} |"
        for r in doc["gemm"]
    ]
    lines += [
        "",
        "| backend | batch | q x kv | causal | fwd TFLOP/s | bwd TFLOP/s |",
        "|---|---:|---|---|---:|---:|",
    ]
    for r in doc["attention"]:
        f = f"{r['fwd_tflops']:.1f} | {r['bwd_tflops']:.1f}" if "fwd_tflops" in r else "n/a | n/a"
        lines.append(
            f"| {r['backend']} | {r['batch']} | {r['sq']}x{r['skv']} | {r['causal']} | {f} |"
        )
    _write(out, doc, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
