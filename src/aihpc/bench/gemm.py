"""GEMM benchmark: achieved TFLOP/s of torch.matmul against shape, at one precision.

FLOPs of C[m,n] = A[m,k] @ B[k,n] are 2*m*n*k (one multiply and one add per term). Time is the host
wall clock around ``iters`` back-to-back matmuls with one device sync at the end, after ``warmup``
untimed ones, so the result is what a training step's GEMM achieves, launch overhead included.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from aihpc.spec.errors import SpecError

__all__ = [
    "PRECISIONS",
    "GemmConfig",
    "GemmResult",
    "device_name",
    "gemm_json",
    "parse_shape",
    "run_gemm_bench",
]

PRECISIONS = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "tf32": torch.float32,
}


@dataclass(frozen=True)
class GemmConfig:
    shapes: tuple[tuple[int, int, int], ...]
    precision: str = "bf16"
    iters: int = 10
    warmup: int = 2


@dataclass(frozen=True)
class GemmResult:
    m: int
    n: int
    k: int
    precision: str
    gflop: float
    time_us: float
    tflops: float


def parse_shape(text: str) -> tuple[int, int, int]:
    """``4096`` (square) or ``MxNxK``."""
    parts = text.lower().replace("*", "x").split("x")
    try:
        dims = [int(p) for p in parts]
    except ValueError:
        dims = []
    if len(dims) == 1:
        dims *= 3
    if len(dims) != 3 or min(dims) < 1:
        raise SpecError("--shape", text, "M, N, K > 0 written MxNxK (or one number for a cube)")
    return dims[0], dims[1], dims[2]


def run_gemm_bench(
    cfg: GemmConfig,
    device: torch.device | None = None,
    on_result: Callable[[GemmResult], None] | None = None,
) -> list[GemmResult]:
    if cfg.precision not in PRECISIONS:
        raise SpecError("--precision", cfg.precision, "allowed: " + " | ".join(PRECISIONS))
    if cfg.iters < 1:
        raise SpecError("-n/--iters", cfg.iters, "must be >= 1")
    if cfg.warmup < 0:
        raise SpecError("-w/--warmup-iters", cfg.warmup, "must be >= 0")
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = PRECISIONS[cfg.precision]
    results = []
    # fp32 on tensor cores only when tf32 is asked for; restored afterwards
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = cfg.precision == "tf32"
    try:
        for m, n, k in cfg.shapes:
            a = torch.randn(m, k, device=device).to(dtype)
            b = torch.randn(k, n, device=device).to(dtype)
            for _ in range(cfg.warmup):
                torch.matmul(a, b)
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(cfg.iters):
                torch.matmul(a, b)
            _sync(device)
            sec = (time.perf_counter() - t0) / cfg.iters
            flop = 2.0 * m * n * k
            res = GemmResult(m, n, k, cfg.precision, flop / 1e9, sec * 1e6, flop / sec / 1e12)
            results.append(res)
            if on_result:
                on_result(res)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32
    return results


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.machine()} ({torch.get_num_threads()} threads)"


def gemm_json(results: Sequence[GemmResult], device: torch.device) -> dict[str, Any]:
    return {
        "benchmark": "gemm",
        "device": device_name(device),
        "torch_version": torch.__version__,
        "results": [asdict(r) for r in results],
    }
