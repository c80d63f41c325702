"""Calibrate the performance model on the machine at hand (``aihpc calibrate --local``).

Measures what the model needs to price a plan on this host, with the project's own benchmarks:

* GEMM throughput (``aihpc bench gemm``) at the thread count a training rank gets (the launcher
  gives each of N local ranks ``OMP_NUM_THREADS=1`` when N > 1; one rank keeps every core);
* the collectives the trainer uses, on N local ranks of this host's backend (``aihpc bench
  comm``: gloo on CPUs, NCCL on GPUs), fitted as ``aihpc calibrate`` fits any measurement;
* memory bandwidth (a large tensor copy: read + write bytes over time; on a CPU also over the
  copying thread's CPU time, which other jobs on the host do not stretch) for the memory-bound
  terms (optimizer step, elementwise work), measured first and refused when no memory of the
  device's kind could give it (``check_memory_bandwidth``);
* on a CPU, the host time DTensor's dispatch adds to one op of the trainer's tensor-parallel
  decoder (bench/dtensor_host.py), which the model prices under eager DTensor;
* causal scaled-dot-product attention forward and backward, as fractions of the best GEMM rate
  (the gpu_spec's attention efficiencies: on a CPU the attention kernel runs at a third to half
  the GEMM rate, where the model's default assumes a GPU's fused kernel), at the spec model's
  own call shape and at half its length: the gpu_spec records the length measured
  (``attention_tokens``) and this device's fall-off at shorter calls
  (``attention_half_*_tokens``), so the model does not apply a GPU kernel's length curve,
  anchored at 16K tokens, to a CPU kernel timed at a few hundred (it priced the tiny model's
  128-token backward 5x too slow);
* on a CPU, a decode step's own costs (bench/local_decode.py): the rate a one-row product
  streams the model's weights, one eager op's host time and the one-query attention call's
  rate, which the inference estimate reads (``weight_stream_GBps``, ``host_op_us``,
  ``decode_attention_GBps``).

On a CPU the GEMMs, the attention and the decode figures are timed on the CPU clock (one
thread's CPU time; at n intra-op threads the process's over n), which other jobs on a shared
host do not stretch as they stretch the wall clock (a loaded 2-core host's wall-clock GEMM
table priced prefill 2.6x too slow); a GPU's on the wall clock after a synchronise.

It writes a calibration TOML, and, given a run spec, a copy of it whose ``[cluster]`` describes
this host (``gpu_spec`` from the measurements, ``num_gpus = gpus_per_node = N`` and the
calibration), so ``aihpc train`` prints its measured step time beside a prediction for the same
hardware. On a CPU the runtime computes in fp32 where the spec says bf16 (see docs/runtime.md),
so the GEMM table is written for both precisions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aihpc.bench.local_decode import DecodeHost, DecodeShape
from aihpc.bench.local_sync import CallCost

__all__ = [
    "AttentionCurve",
    "LocalMeasurement",
    "MeasurementError",
    "PLAUSIBLE_MEM_BW_GBps",
    "attention_curve",
    "attention_shape",
    "check_memory_bandwidth",
    "half_tokens",
    "load_warning",
    "local_gpu_spec",
    "measure_local",
    "memory_bandwidth_GBps",
]

# Square GEMMs spanning a tiny model's layer shapes (dim 64 .. 1024 x tokens 256 .. 4096).
_GEMM_SIZES = (128, 256, 512, 1024)
_COLD_BYTES = 64 << 20  # past a server CPU's last-level cache (this host's: 32 MiB)
_COLLECTIVES = "all_reduce,all_gather,reduce_scatter,send_recv,all_to_all"


@dataclass(frozen=True)
class LocalMeasurement:
    nproc: int
    threads_per_rank: int
    device: str
    gemm: dict[str, Any]  # `aihpc bench gemm --json`
    comm: dict[str, Any]  # `aihpc bench comm --json`
    mem_bw_GBps: float
    host_mem_gib: float
    attention: AttentionCurve  # causal SDPA forward, backward, at the model's shape
    call: CallCost | None = None  # a collective between computations (bench/local_sync.py)
    device_type: str = "cpu"
    # host time DTensor adds to one op of the trainer's tensor-parallel layer (CPU hosts only:
    # on a GPU the host runs ahead of the kernels and the figure is not the one that matters)
    dtensor_op_us: float | None = None
    dtensor_optimizer_op_us: float | None = None  # the same for an op of the optimizer step
    # a CPU host's decode-step figures (bench/local_decode.py), on the CPU clock
    decode: DecodeHost | None = None
    # a CPU host's page faults of a training step's fresh allocations (bench/local_faults.py):
    # (one fresh page's microseconds, the share of a step's counted pages that fault)
    faults: tuple[float, float] | None = None


def _threads(nproc: int) -> int:
    """A training rank's intra-op threads: OMP_NUM_THREADS when set (torch reads it), else all
    cores for one rank and one per rank for several (aihpc's launcher sets OMP_NUM_THREADS=1)."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, os.cpu_count() or 1) if nproc == 1 else 1


_COPY_BYTES = 64 << 20  # beyond any last-level cache a rank sees
_COPIES = 5
# What a copy of _COPY_BYTES reaches, bytes read + written, on any device of its kind: the floor
# a DDR3 channel or a phone's LPDDR clears with one core (this 2-core host: 18-26 GB/s on one
# thread), a GPU's a GDDR card's; the ceiling beyond a socket's DRAM (HBM Xeons: ~1 TB/s) and a
# B200's 8 TB/s. A figure outside is a measurement gone wrong, not a fact of the host.
PLAUSIBLE_MEM_BW_GBps = {"cpu": (1.0, 2000.0), "cuda": (20.0, 20000.0)}


class MeasurementError(RuntimeError):
    """A figure ``calibrate --local`` measured is not one the device can have: nothing is
    written (exit 1), where a wrong figure would price every plan on this host wrongly."""


def _best_seconds(copy: Any, clock: Any, sync: Any) -> float:
    """The fastest of _COPIES timings of ``copy()`` on ``clock`` (inf when the clock never
    moved: a clock coarser than one copy)."""
    best = float("inf")
    for _ in range(_COPIES):
        sync()
        t0 = clock()
        copy()
        sync()
        if (dt := clock() - t0) > 0:
            best = min(best, dt)
    return best


def memory_bandwidth_GBps(device: Any) -> float:
    """One rank's memory bandwidth: the best of five copies of 64 MiB at the rank's thread
    count, bytes read + written over the time the copy ran.

    On a CPU the copy is also timed on one thread's own CPU time (``time.thread_time``), and
    the larger figure kept (each is a floor of the rank's: one thread's of its threads', a
    descheduled wall clock's of its own). The wall clock alone measures the share of a core
    the scheduler gave the copy: with 15 busy processes on the copy's core it gave 0.86 GB/s
    where the thread's CPU time gave 18.6 (this 2-core host), and issue 34's host, at load
    10-30, wrote 0.30 GB/s. The destination is touched once first: page faults are not
    bandwidth (the first copy ran at a fifth of the others)."""
    import torch

    a = torch.empty(_COPY_BYTES // 4, dtype=torch.float32, device=device).fill_(1.0)
    b = torch.empty_like(a).copy_(a)
    nbytes = 2 * _COPY_BYTES
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    best = nbytes / _best_seconds(lambda: b.copy_(a), time.perf_counter, sync)
    if not cuda:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            cpu = nbytes / _best_seconds(lambda: b.copy_(a), time.thread_time, sync)
        finally:
            torch.set_num_threads(threads)
        best = max(best, cpu)
    return best / 1e9


def check_memory_bandwidth(device_type: str, GBps: float) -> None:
    """Raise MeasurementError when ``GBps`` is outside what a memory of the device's kind
    gives (PLAUSIBLE_MEM_BW_GBps), naming the figure, the range and why."""
    low, high = PLAUSIBLE_MEM_BW_GBps.get(device_type, PLAUSIBLE_MEM_BW_GBps["cuda"])
    if low <= GBps <= high:
        return
    raise MeasurementError(
        f"memory bandwidth measured {GBps:.3g} GB/s per rank (a 64 MiB copy, bytes read + "
        f"written), outside the {low:g}-{high:g} GB/s any {device_type.upper()} memory gives: "
        "the copy was not timed as it ran (a host swapping or throttled?), and the figure "
        "would price every memory-bound term on this host; nothing written"
    )


# The attention shape measured when no run spec names one: batch 4, 8 heads of 64, 512 tokens.
DEFAULT_ATTENTION_SHAPE = (4, 8, 8, 512, 64)


@dataclass(frozen=True)
class AttentionCurve:
    """Causal SDPA on this device at one shape: TFLOP/s forward and backward on calls of
    ``tokens`` keys, and the key lengths at which the kernel reaches half its long-call rate
    (forward, backward), from a second timing at half the length."""

    tflops: tuple[float, float]
    tokens: int
    halves: tuple[float, float]


def attention_shape(model: Any, micro_batch_size: int | None) -> tuple[int, int, int, int, int]:
    """(batch, heads, kv heads, sequence, head dim) of a model's attention calls at one rank
    (a ModelSpec; the spec's micro-batch, else 4)."""
    heads = model.num_attention_heads
    return (micro_batch_size or 4, heads, model.kv_heads, model.seq_length, model.kv_channels)


def half_tokens(rate: float, rate_at_half: float, tokens: int) -> float:
    """The key length s_half of the curve rate(s) = rate_long * s / (s + s_half) through the
    rates at ``tokens`` and ``tokens / 2``: r = rate / rate_at_half = 2 (s/2 + s_half) / (s +
    s_half), so s_half = s (r - 1) / (2 - r). No fall-off measured (r <= 1): 0; a fall-off
    steeper than the curve allows (r near 2) is capped at r = 1.95 (s_half = 19 s)."""
    r = min(rate / rate_at_half, 1.95)
    return 0.0 if r <= 1 else tokens * (r - 1) / (2 - r)


def _clock(device: Any) -> Callable[[], float]:
    """The wall clock on a GPU (synchronised); a CPU's CPU clock (bench/local_decode.cpu_clock),
    which other jobs on a shared host do not stretch."""
    from aihpc.bench.local_decode import cpu_clock

    return time.perf_counter if device.type == "cuda" else cpu_clock()


def _attention_tflops(device: Any, iters: int, shape: tuple[int, ...]) -> tuple[float, float]:
    """Causal SDPA forward and backward at ``shape`` (batch, heads, kv heads, seq, head dim),
    TFLOP/s counted as the model counts them (the causal half of the 4·s²·d score and value
    matmuls per head; the backward 2.5x the forward); best of the timings (on ``_clock``)."""
    import torch
    import torch.nn.functional as F

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    b, h, kv, s, d = shape

    def tensor(heads: int) -> Any:
        return torch.randn(b, heads, s, d, device=device, dtype=dtype, requires_grad=True)

    q, k, v = tensor(h), tensor(kv), tensor(kv)
    flops = 4 * b * s * s * h * d * 0.5

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fwd = bwd = float("inf")
    clock = _clock(device)
    for _ in range(max(3, iters // 2)):
        sync()
        t0 = clock()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != h)
        sync()
        t1 = clock()
        out.backward(torch.ones_like(out))
        sync()
        t2 = clock()
        fwd, bwd = min(fwd, max(t1 - t0, 1e-9)), min(bwd, max(t2 - t1, 1e-9))
    return flops / fwd / 1e12, 2.5 * flops / bwd / 1e12


def attention_curve(device: Any, iters: int, shape: tuple[int, ...]) -> AttentionCurve:
    """The attention kernel at ``shape`` and at half its length (the length curve's anchor and
    slope on this device; a GPU kernel's curve is not a CPU's)."""
    b, h, kv, s, d = shape
    full = _attention_tflops(device, iters, shape)
    half = _attention_tflops(device, iters, (b, h, kv, max(1, s // 2), d))
    halves = (half_tokens(full[0], half[0], s), half_tokens(full[1], half[1], s))
    return AttentionCurve(full, s, halves)


def _host_mem_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 16.0


class _Phases:
    """Announces each measurement phase through ``report``: i of n, the time since the first,
    and what it measures (a run takes one to two minutes on an idle 2-core host, ten on a
    loaded one; it should not look hung)."""

    def __init__(self, total: int, report: Callable[[str], None] | None) -> None:
        self.total, self.report, self.done = total, report, 0
        self.start = time.perf_counter()

    def __call__(self, what: str) -> None:
        self.done += 1
        if self.report is not None:
            m, sec = divmod(int(time.perf_counter() - self.start), 60)
            self.report(f"[{self.done}/{self.total}] {m}:{sec:02d} {what}")


def _gemms(device: Any, iters: int) -> dict[str, Any]:
    """`aihpc bench gemm --json` of _GEMM_SIZES (on a CPU with cold operands), best of three
    timings per shape: on a shared
    host the run least slowed by other work (the benchmark compares with a step's fastest time
    too). Measured on the loaded 2-core host: one timing per shape gave 10-16 GFLOP/s for
    512^3..1024^3 where the same GEMMs reach about 88 GFLOP/s undisturbed, and predicted a
    1-rank step 2.6x too slow."""
    from aihpc.bench.gemm import GemmConfig, gemm_json, run_gemm_bench

    precision = "bf16" if device.type == "cuda" else "fp32"
    shapes = tuple((s, s, s) for s in _GEMM_SIZES)
    # a CPU: each GEMM's operands out of the cache, as in a training step (the element-wise ops
    # between its GEMMs evict them); hot, the calibration priced a step's GEMMs 10-30% faster
    # than they ran in it (tiny-llama-small's 512 x 704 x 256: 92 GFLOP/s hot, 76 cold; 128^3
    # 85 and 59; here, on one core's CPU time)
    cold = _COLD_BYTES if device.type == "cpu" else 0
    cfg = GemmConfig(shapes=shapes, precision=precision, iters=iters, cold_bytes=cold)
    clock = _clock(device)  # a CPU's CPU clock: a loaded host's waits left out
    runs = [run_gemm_bench(cfg, device, clock=clock) for _ in range(3)]
    return gemm_json([max(rs, key=lambda r: r.tflops) for rs in zip(*runs, strict=True)], device)


def _collectives(nproc: int, iters: int) -> dict[str, Any]:
    """`aihpc bench comm --json` on ``nproc`` local ranks, without its values check (the
    calibration reads times only; the check cost a third of the benchmark's CPU time)."""
    with tempfile.TemporaryDirectory(prefix="aihpc-local-") as tmp:
        out = Path(tmp) / "comm.json"
        cmd = [
            sys.executable, "-m", "aihpc", "bench", "comm", "-C", _COLLECTIVES,
            "-b", "1K", "-e", "16M", "-f", "4", "-n", str(iters), "-c", "0",
            "--nproc-per-node", str(nproc), "--output", str(out),
        ]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if r.returncode != 0 or not out.exists():
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"aihpc bench comm failed: {tail[0]}")
        return json.loads(out.read_text())


def measure_local(
    nproc: int,
    iters: int = 10,
    attention: tuple[int, ...] = DEFAULT_ATTENTION_SHAPE,
    progress: Callable[[str], None] | None = None,
    decode: DecodeShape | None = None,
    faults_target: tuple[Any, int, float] | None = None,
) -> LocalMeasurement:
    """Run the memory, GEMM, attention and collective measurements for ``nproc`` local ranks;
    ``attention``: the shape of the model's attention calls (``attention_shape``); each phase
    announced through ``progress``. The memory bandwidth comes first and is checked
    (``check_memory_bandwidth``) before minutes of the rest."""
    import torch

    from aihpc.bench.gemm import device_name
    from aihpc.bench.local_sync import interleaved_call_cost

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cpu, several, threads = device.type == "cpu", nproc > 1, _threads(nproc)
    faulted = cpu and faults_target is not None
    phase = _Phases(3 + several + (cpu and several) + 2 * cpu + faulted, progress)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        phase(f"memory bandwidth: {_COPIES} copies of 64 MiB at {threads} thread(s)")
        mem_bw = memory_bandwidth_GBps(device)
        check_memory_bandwidth(device.type, mem_bw)
        phase(f"GEMMs: {len(_GEMM_SIZES)} shapes x 3 timings at {threads} thread(s)")
        gemm, name = _gemms(device, iters), device_name(device)
        seq = attention[3]
        phase(f"attention forward and backward at {seq} and {max(1, seq // 2)} tokens")
        curve = attention_curve(device, iters, attention)
        host = None
        if cpu:
            from aihpc.bench.local_decode import DEFAULT_DECODE_SHAPE, measure_decode_host

            phase("decode step: weights streamed at one row, an eager op, a one-query attention")
            host = measure_decode_host(decode or DEFAULT_DECODE_SHAPE)
    finally:
        torch.set_num_threads(old)
    comm: dict[str, Any] = {}
    if several:
        kinds = len(_COLLECTIVES.split(","))
        phase(f"collectives: {kinds} kinds x 8 sizes on {nproc} ranks (aihpc bench comm)")
        comm = _collectives(nproc, iters)
    if cpu and several:
        phase(f"an all-gather's cost between and beside GEMMs on {nproc} ranks")
    call = interleaved_call_cost(nproc) if cpu else None
    dtensor = dtensor_opt = None
    if cpu:
        from aihpc.bench.dtensor_host import measure_dtensor_host

        phase("DTensor's host time per op: a tensor-parallel decoder on a one-rank mesh")
        dtensor, dtensor_opt = (float(f"{x:.4g}") for x in measure_dtensor_host(attention))
    faults = _faults(faults_target, phase) if faulted else None
    return LocalMeasurement(
        nproc, threads, name, gemm, comm, mem_bw, _host_mem_gib(), curve, call, device.type,
        dtensor, dtensor_opt, host, faults,
    )  # fmt: skip


def _faults(target: tuple[Any, int, float], phase: Callable[[str], None]) -> tuple[float, float]:
    """(one fresh page's microseconds, the share of the trainer's step's counted large-allocation
    pages that fault) for ``target``: (a dense ModelSpec, sequences a micro-batch, the pages
    perf/step/page_faults counts for its step)."""
    from aihpc.bench.local_faults import fresh_fault_fraction, page_fault_us

    phase("page faults: a fresh page's cost, and the share of a training step's that fault")
    return float(f"{page_fault_us():.4g}"), float(f"{fresh_fault_fraction(*target):.4g}")


def load_warning() -> str | None:
    """A sentence when other work shares this host's cores (the 1-minute load average above
    the core count), else None."""
    try:
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
    except (OSError, AttributeError):  # no load average on this platform
        return None
    if load <= cores:
        return None
    return (
        f"load average {load:.1f} on {cores} cores: other work shares this host, so the "
        "measurement takes longer (each phase waits for its share of the cores) and its "
        "wall-clock figures (the collectives) may price the host as loaded; the memory "
        "bandwidth, GEMMs, attention and decode figures are timed on CPU time and hold "
        "better (memory traffic of the other work still slows them)"
    )


def local_gpu_spec(m: LocalMeasurement) -> dict[str, Any]:
    """A ``[cluster.gpu_spec]`` table for this host as N ranks: the best GEMM rate measured is
    the peak (the calibration's GEMM table prices each shape), one rank's memory bandwidth, and
    the best point-to-point bus bandwidth measured as the link (scale-up and scale-out alike:
    one host)."""
    best_tflops = max(r["tflops"] for r in m.gemm["results"])
    link = max(
        (
            float(r["busbw_GBps"])
            for r in m.comm.get("results", [])
            if r["collective"] == "send_recv"
        ),
        default=0.0,
    )
    link = link or m.mem_bw_GBps  # one rank: no link is used

    def sig(x: float) -> float:  # six significant digits (a CPU's TFLOP/s are small numbers)
        return float(f"{x:.6g}")

    return {
        "name": f"{m.device} as {m.nproc} rank(s)",
        "source": "measured by aihpc calibrate --local",
        "bf16_tflops": sig(best_tflops),
        "fp32_tflops": sig(best_tflops),
        "hbm_gib": sig(m.host_mem_gib / m.nproc),
        # a rank's own: measured at a rank's thread count (one thread, one core, for N > 1
        # ranks), not the host's total, so not divided by N. Measured here: two single-thread
        # copies at once each reached 18.6 and 20.3 GB/s, one alone 21.9. (Divided by N, the
        # figure was halved for 2 ranks: 0.30 GB/s of issue 34 was 0.6 on a loaded host.)
        "hbm_bw_GBps": sig(m.mem_bw_GBps),
        "scale_up_bw_GBps": sig(link),
        "scale_up_domain": m.nproc,
        "scale_out_bw_GBps": sig(link),
        "gpus_per_node": m.nproc,
        "gemm_efficiency": 1.0,
        # the attention kernel's own rate, as a fraction of the peak (the best GEMM measured),
        # on calls of the length measured, and how it falls at shorter ones
        "attention_fwd_efficiency": sig(min(1.0, m.attention.tflops[0] / best_tflops)),
        "attention_bwd_efficiency": sig(min(1.0, m.attention.tflops[1] / best_tflops)),
        "attention_tokens": m.attention.tokens,
        "attention_half_fwd_tokens": sig(m.attention.halves[0]),
        "attention_half_bwd_tokens": sig(m.attention.halves[1]),
        "host_is_device": m.device_type == "cpu",
        # a CPU host's decode step (bench/local_decode.py): weights streamed by a one-row
        # product, one eager op's host time, the one-query attention call's rate
        **(
            {
                "weight_stream_GBps": m.decode.weight_stream_GBps,
                "host_op_us": m.decode.host_op_us,
                "decode_attention_GBps": m.decode.decode_attention_GBps,
            }
            if m.decode is not None
            else {}
        ),
        # a CPU host's page faults of a training step's fresh allocations (perf/step/page_faults)
        **(
            {"page_fault_us": m.faults[0], "fresh_fault_fraction": m.faults[1]}
            if m.faults is not None
            else {}
        ),
    }
