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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aihpc.runspec.errors import SpecError

if TYPE_CHECKING:  # torch is imported where a GEMM runs, so flags are checked without it
    import torch

__all__ = [
    "PRECISIONS",
    "GemmConfig",
    "GemmResult",
    "device_name",
    "gemm_bytes",
    "gemm_json",
    "parse_shape",
    "run_gemm_bench",
    "validate_gemm_config",
]

# precision -> torch dtype name; tf32 is fp32 on tensor cores (allow_tf32)
PRECISIONS = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "tf32": "float32"}
_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "tf32": 4}


@dataclass(frozen=True)
class GemmConfig:
    shapes: tuple[tuple[int, int, int], ...]
    precision: str = "bf16"
    iters: int = 10
    warmup: int = 2
    # Bytes of operands to rotate through (0: one pair, hot in the cache): each call then finds
    # its A and B out of the cache, as a training step's GEMMs do after the element-wise ops
    # between them (`calibrate --local` on a CPU).
    cold_bytes: int = 0


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


def validate_gemm_config(cfg: GemmConfig) -> GemmConfig:
    """Raise SpecError naming the flag for anything the run cannot do (no torch needed)."""
    if cfg.precision not in PRECISIONS:
        raise SpecError("--precision", cfg.precision, "allowed: " + " | ".join(PRECISIONS))
    if cfg.iters < 1:
        raise SpecError("-n/--iters", cfg.iters, "must be >= 1")
    if cfg.warmup < 0:
        raise SpecError("-w/--warmup-iters", cfg.warmup, "must be >= 0")
    return cfg


def gemm_bytes(m: int, n: int, k: int, precision: str) -> int:
    """Peak bytes of one shape: A, B and C at ``precision`` plus the fp32 random source of the
    larger input, which ``torch.randn`` makes before the cast."""
    return (m * k + k * n + m * n) * _BYTES[precision] + 4 * max(m * k, k * n)


def _free_bytes(device: torch.device) -> int | None:
    """Memory a new allocation can take: the GPU's free memory, or the host's MemAvailable."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _too_big(m: int, n: int, k: int, cfg: GemmConfig, device: torch.device, free: int) -> None:
    need = gemm_bytes(m, n, k, cfg.precision)
    raise SpecError(
        "--shape",
        f"{m}x{n}x{k}",
        f"needs {need / 2**30:,.1f} GiB at {cfg.precision} (A, B, C); {device.type} has "
        f"{free / 2**30:,.1f} GiB free: use smaller shapes",
    )


def run_gemm_bench(
    cfg: GemmConfig,
    device: torch.device | None = None,
    on_result: Callable[[GemmResult], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> list[GemmResult]:
    """Time every shape on ``clock`` (the wall clock; `calibrate --local` passes a CPU's CPU
    clock, bench/local_decode.cpu_clock); a shape that cannot fit in memory is a SpecError
    before allocating, and an out-of-memory error while allocating is one too (one line,
    never a traceback)."""
    import torch

    validate_gemm_config(cfg)
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, PRECISIONS[cfg.precision])
    results = []
    # fp32 on tensor cores only when tf32 is asked for; restored afterwards
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = cfg.precision == "tf32"
    try:
        for m, n, k in cfg.shapes:
            free = _free_bytes(device)
            if free is not None and gemm_bytes(m, n, k, cfg.precision) > free:
                _too_big(m, n, k, cfg, device, free)
            try:
                res = _time_shape(m, n, k, cfg, device, dtype, clock)
            except (torch.OutOfMemoryError, RuntimeError) as err:
                # CUDA raises OutOfMemoryError; the CPU allocator may raise a plain RuntimeError
                if not isinstance(err, torch.OutOfMemoryError) and "memory" not in str(err):
                    raise
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                _too_big(m, n, k, cfg, device, _free_bytes(device) or 0)
            results.append(res)
            if on_result:
                on_result(res)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32
    return results


def _time_shape(
    m: int,
    n: int,
    k: int,
    cfg: GemmConfig,
    device: torch.device,
    dtype: Any,
    clock: Callable[[], float] = time.perf_counter,
) -> GemmResult:
    import torch

    pairs = [
        (torch.randn(m, k, device=device).to(dtype), torch.randn(k, n, device=device).to(dtype))
        for _ in range(operand_pairs(m, n, k, cfg))
    ]
    for i in range(cfg.warmup):
        torch.matmul(*pairs[i % len(pairs)])
    _sync(device)
    t0 = clock()
    for i in range(cfg.iters):
        torch.matmul(*pairs[i % len(pairs)])
    _sync(device)
    sec = max(clock() - t0, 1e-9) / cfg.iters
    flop = 2.0 * m * n * k
    return GemmResult(m, n, k, cfg.precision, flop / 1e9, sec * 1e6, flop / sec / 1e12)


def operand_pairs(m: int, n: int, k: int, cfg: GemmConfig) -> int:
    """How many (A, B) pairs a shape's timing rotates through: enough to hold ``cold_bytes``
    (each call's operands then evicted since its last use), one without it."""
    if cfg.cold_bytes <= 0:
        return 1
    one = (m * k + k * n) * _BYTES[cfg.precision]
    return max(1, -(-cfg.cold_bytes // one))


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.machine()} ({torch.get_num_threads()} threads)"


def gemm_json(results: Sequence[GemmResult], device: torch.device) -> dict[str, Any]:
    import torch

    return {
        "benchmark": "gemm",
        "device": device_name(device),
        "torch_version": torch.__version__,
        "results": [asdict(r) for r in results],
    }
