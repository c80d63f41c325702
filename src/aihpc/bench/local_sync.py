"""What one collective costs when a training step issues it between computations, on this host.

`aihpc bench comm` times collectives back to back: the ranks stay in lockstep and each call
pays only the transport's latency. A training rank computes between calls (tensor parallelism:
a gather or reduction between every pair of GEMMs), so every call also waits for the slowest
rank to arrive; on a CPU host, where gloo runs on the cores that compute and other processes
share them, that wait is most of the cost. Measured on the 2-core CI host under load (2 ranks,
gloo, a 256 KiB all-gather after four 512x256x704 GEMMs): 1.7 ms a call back to back, 9.8 ms
more a call when issued between the GEMMs (docs/benchmarks.md, the run of December 2026).

``interleaved_call_cost`` measures it: N local gloo ranks run k steps of (compute chunk, one
all-gather) and k steps of the compute chunk alone, at a small and a large message; the
difference per call is what the call costs inside a step. Each timing is a mean over its k
calls and the figure the median over repeats: a step's time is a sum over its calls, so the
typical call is what it pays, not the luckiest (the best-of-repeats figure this module gave
before moved 0.4-5 ms a call between runs on a quiet host). The two sizes give a latency and a
bandwidth (`aihpc calibrate --local` makes them a floor and a ceiling of every collective's
fit): on this 2-core host a 4 KiB call cost 2.5-6.6 ms between GEMMs (0.7-1.1 ms back to back)
and a 512 KiB one 4.2-5.8 ms (2.3-2.7 ms), so a fixed per-call latency measured at 4 KiB
missed how the waiting grows with the message.

It also times the large all-gather started asynchronously beside the same GEMMs: what it still
adds, as a fraction of its own back-to-back time, is the host's ``overlap_compute_penalty``
(the calibration carries it in place of the model's 0.189, a GPU measurement). On this 2-core
host it was 0.74-0.85: gloo moves the bytes on the cores that compute, so a collective the
framework overlaps (DDP's bucketed all-reduce, FSDP2's prefetched gathers, the ring's K/V)
mostly does not hide.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from aihpc.spec.calibration import Calibration, CommFit

__all__ = ["CallCost", "call_cost_fit", "interleaved_call_cost", "with_call_cost"]

_CALLS = 16
_REPEATS = 9  # 5 measured the overlap penalty at 1.0, 0.20 and 0.94 in three calibrations
# Per-rank inputs of the two timed all-gathers (fp32 elements): 4 KiB and 512 KiB, a tiny
# model's tensor-parallel activation at micro-batch 4.
_SIZES = (1024, 131072)


@dataclass(frozen=True)
class CallCost:
    """What one collective costs issued between computations: a latency and, from the slope
    between the two message sizes, a bus bandwidth (None when the larger call was not slower);
    and how much of a collective started asynchronously beside computation still adds to it
    (``overlap_penalty``, a fraction of the collective's own time; None: not measured)."""

    latency_us: float
    busbw_GBps: float | None
    overlap_penalty: float | None = None


def _timed(body: Any) -> float:
    """Seconds per call of ``body``, the mean over _CALLS calls started together on all ranks."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(_CALLS):
        body()
    return (time.perf_counter() - t0) / _CALLS


def _extra_per_call(compute: Any, gather: Any) -> float:
    """Median over repeats of (compute then the all-gather - compute alone), per call."""

    def both() -> None:
        compute()
        gather()

    return statistics.median(-_timed(compute) + _timed(both) for _ in range(_REPEATS))


def _overlap_penalty(compute: Any, gather: Any, start: Any) -> float:
    """Median over repeats of (compute with an async all-gather beside it - compute alone) /
    (the all-gather alone), clamped to [0, 1]: 0 when the collective hides for free, 1 when
    it costs as much as issued on its own (gloo's transfers run on the cores that compute)."""

    def beside() -> None:
        work = start()
        compute()
        work.wait()

    def ratio() -> float:
        alone, comm = _timed(compute), _timed(gather)
        return (_timed(beside) - alone) / comm

    return min(1.0, max(0.0, statistics.median(ratio() for _ in range(_REPEATS))))


def _worker(rank: int, nproc: int, init: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=nproc)
    a, b = torch.randn(512, 256), torch.randn(256, 704)  # one tiny-model FFN GEMM

    def compute() -> None:
        for _ in range(4):
            torch.matmul(a, b)

    costs = []
    for n in _SIZES:
        x, gathered = torch.randn(n), torch.empty(nproc * n)

        def gather(x: Any = x, out: Any = gathered, async_op: bool = False) -> Any:
            return dist.all_gather_into_tensor(out, x, async_op=async_op)

        costs.append(_extra_per_call(compute, gather))
    # the larger all-gather (the last ``gather``) started beside the GEMMs
    costs.append(_overlap_penalty(compute, gather, lambda: gather(async_op=True)))
    if rank == 0:
        Path(out).write_text(json.dumps(costs))
    dist.destroy_process_group()


def call_cost_fit(
    nproc: int, seconds: list[float], overlap_penalty: float | None = None
) -> CallCost:
    """Latency and bus bandwidth of the line through the two sizes' per-call costs (the whole
    gathered buffer is the message, as `aihpc bench comm` counts it; all-gather's bus factor
    (n - 1) / n), four significant digits."""
    small, large = (nproc * n * 4 for n in _SIZES)
    t_small, t_large = (max(0.0, t) for t in seconds)
    slope = (t_large - t_small) / (large - small)  # seconds per byte
    if slope <= 0:
        return CallCost(_sig(t_small * 1e6), None, overlap_penalty)
    latency = max(0.0, t_small - slope * small)
    return CallCost(_sig(latency * 1e6), _sig((nproc - 1) / nproc / slope / 1e9), overlap_penalty)


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def interleaved_call_cost(nproc: int) -> CallCost:
    """What one all-gather costs when issued between computations, on ``nproc`` local gloo
    ranks of one thread each (nothing for one rank)."""
    if nproc <= 1:
        return CallCost(0.0, None)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="aihpc-sync-") as tmp:
        init = "file://" + os.path.join(tmp, "store")
        out = os.path.join(tmp, "cost")
        mp.spawn(_worker, args=(nproc, init, out), nprocs=nproc, join=True)
        small, large, penalty = json.loads(Path(out).read_text())
        return call_cost_fit(nproc, [small, large], _sig(penalty))


def with_call_cost(cal: Calibration, cost: CallCost) -> Calibration:
    """The calibration with every collective regime's latency raised to at least
    ``cost.latency_us`` and its bus bandwidth lowered to at most ``cost.busbw_GBps`` (what a
    call costs inside a training step; larger latencies and lower bandwidths stay), and the
    measured overlap penalty in place of the model's."""
    if cost.overlap_penalty is not None:
        cal = replace(cal, overlap_compute_penalty=cost.overlap_penalty)
    if cost.latency_us <= 0 and cost.busbw_GBps is None:
        return cal
    comm: dict[Any, CommFit] = {}
    for key, fit in cal.comm.items():
        regimes = tuple(
            replace(
                r,
                latency_us=max(r.latency_us, cost.latency_us),
                busbw_GBps=min(r.busbw_GBps, cost.busbw_GBps or r.busbw_GBps),
            )
            for r in fit.regimes
        )
        comm[key] = replace(fit, regimes=regimes)
    return replace(cal, comm=comm)
