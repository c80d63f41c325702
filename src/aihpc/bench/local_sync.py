"""What one collective costs when a training step issues it between computations, on this host.

`aihpc bench comm` times collectives back to back: the ranks stay in lockstep and each call
pays only the transport's latency. A training rank computes between calls (tensor parallelism:
a gather or reduction between every pair of GEMMs), so every call also waits for the slowest
rank to arrive; on a CPU host, where gloo runs on the cores that compute and other processes
share them, that wait is most of the cost. Measured on the 2-core CI host under load (2 ranks,
gloo, a 256 KiB all-gather after four 512x256x704 GEMMs): 1.7 ms a call back to back, 9.8 ms
more a call when issued between the GEMMs (docs/benchmarks.md, the run of December 2026).

``interleaved_call_cost`` measures it: N local gloo ranks run k steps of (compute chunk, one
all-gather) and k steps of the compute chunk alone, at three message sizes; the difference per
call is what the call costs inside a step. Each timing is a mean over its k
calls and the figure the median over repeats: a step's time is a sum over its calls, so the
typical call is what it pays, not the luckiest (the best-of-repeats figure this module gave
before moved 0.4-5 ms a call between runs on a quiet host). The two sizes give a latency and a
bandwidth (`aihpc calibrate --local` makes them a floor and a ceiling of every collective's
fit): on this 2-core host a 4 KiB call cost 2.5-6.6 ms between GEMMs (0.7-1.1 ms back to back)
and a 512 KiB one 4.2-5.8 ms (2.3-2.7 ms), so a fixed per-call latency measured at 4 KiB
missed how the waiting grows with the message. Past the middle size it grows more slowly (the
wait a smaller part of a longer transfer), so the two larger sizes give a second line for the
large messages (a data-parallel gradient bucket).

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

from aihpc.runspec.calibration import Calibration, CommFit, CommRegime

__all__ = ["CallCost", "call_cost_fit", "interleaved_call_cost", "with_call_cost"]

_CALLS = 16
_REPEATS = 9  # 5 measured the overlap penalty at 1.0, 0.20 and 0.94 in three calibrations
# Per-rank inputs of the timed all-gathers (fp32 elements): 4 KiB, 512 KiB (a tiny model's
# tensor-parallel activation at micro-batch 4) and 4 MiB (a data-parallel gradient bucket's
# order of size).
_SIZES = (1024, 131072, 1048576)


@dataclass(frozen=True)
class CallCost:
    """What one collective costs issued between computations: a latency and, from the slope
    between the two message sizes, a bus bandwidth (None when the larger call was not slower);
    and how much of a collective started asynchronously beside computation still adds to it
    (``overlap_penalty``, a fraction of the collective's own time; None: not measured)."""

    latency_us: float
    busbw_GBps: float | None
    overlap_penalty: float | None = None
    # Above ``split_bytes`` (the middle size timed) the line through the two larger sizes,
    # (latency_us, busbw_GBps): the in-step cost grows more slowly with the message there, the
    # wait for the other ranks a smaller part of it (2 ranks, an all-reduce between GEMMs:
    # 2.1, 4.3, 7.0 and 9.7 ms at 4 KiB, 512 KiB, 4 MiB and 6.5 MiB, where the line through the
    # two smaller sizes gives 31 ms at 6.5 MiB). None: one line for every size.
    split_bytes: float | None = None
    large: tuple[float, float | None] | None = None


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

    # torch 2.13's name (the old one warns on every call, through calibrate's output), as
    # bench/comm.py does
    _all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

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
            return _all_gather(out, x, async_op=async_op)

        costs.append(_extra_per_call(compute, gather))
        if n == _SIZES[1]:
            penalty_gather = gather
    # the 512 KiB all-gather started beside the GEMMs
    costs.append(_overlap_penalty(compute, penalty_gather, lambda: penalty_gather(async_op=True)))
    if rank == 0:
        Path(out).write_text(json.dumps(costs))
    dist.destroy_process_group()


def _line(nproc: int, points: list[tuple[float, float]]) -> tuple[float, float | None]:
    """(latency us, bus bandwidth GB/s or None) of the line through two (bytes, seconds) points
    of all-gathers (the bus factor (n - 1) / n), the latency at least 0; a flat or falling
    line is a latency alone, the larger point's."""
    (b0, t0), (b1, t1) = ((b, max(0.0, t)) for b, t in points)
    slope = (t1 - t0) / (b1 - b0)  # seconds per byte
    if slope <= 0:
        return _sig(t1 * 1e6), None
    latency = max(0.0, t0 - slope * b0)
    return _sig(latency * 1e6), _sig((nproc - 1) / nproc / slope / 1e9)


def call_cost_fit(
    nproc: int, seconds: list[float], overlap_penalty: float | None = None
) -> CallCost:
    """The line through the first two sizes' per-call costs (latency and bus bandwidth; the
    whole gathered buffer is the message, as `aihpc bench comm` counts it) and, given a third
    size, the line through the two larger ones above the middle size; four significant
    digits."""
    sizes = [nproc * n * 4 for n in _SIZES[: len(seconds)]]
    points = list(zip(sizes, seconds, strict=True))
    small = points[:2]
    if small[1][1] <= small[0][1]:  # the larger call was not slower: the smaller's latency
        latency, busbw = _sig(max(0.0, small[0][1]) * 1e6), None
    else:
        latency, busbw = _line(nproc, small)
    cost = CallCost(latency, busbw, overlap_penalty)
    if len(points) < 3:
        return cost
    return replace(cost, split_bytes=float(sizes[1]), large=_line(nproc, points[1:]))


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
        *seconds, penalty = json.loads(Path(out).read_text())
        return call_cost_fit(nproc, seconds, _sig(penalty))


def _floored(regime: CommRegime, floor: tuple[float, float | None]) -> CommRegime:
    latency, busbw = floor
    return replace(
        regime,
        latency_us=max(regime.latency_us, latency),
        busbw_GBps=min(regime.busbw_GBps, busbw or regime.busbw_GBps),
    )


def _floored_regimes(fit: CommFit, cost: CallCost) -> tuple[CommRegime, ...]:
    """``fit``'s regimes under ``cost``'s floor and ceiling: the small sizes' line up to
    ``cost.split_bytes``, the large sizes' above it (a regime across the split becomes two)."""
    small = (cost.latency_us, cost.busbw_GBps)
    if cost.split_bytes is None or cost.large is None:
        return tuple(_floored(r, small) for r in fit.regimes)
    split, out, low = cost.split_bytes, [], 0.0
    for r in fit.regimes:
        if r.max_bytes <= split:
            out.append(_floored(r, small))
        elif low >= split:
            out.append(_floored(r, cost.large))
        else:
            out += [_floored(replace(r, max_bytes=split), small), _floored(r, cost.large)]
        low = r.max_bytes
    return tuple(out)


def with_call_cost(cal: Calibration, cost: CallCost) -> Calibration:
    """The calibration with every collective regime's latency raised to at least the in-step
    latency and its bus bandwidth lowered to at most the in-step bandwidth of its sizes (what a
    call costs inside a training step; larger latencies and lower bandwidths stay), and the
    measured overlap penalty in place of the model's."""
    if cost.overlap_penalty is not None:
        cal = replace(cal, overlap_compute_penalty=cost.overlap_penalty)
    if cost.latency_us <= 0 and cost.busbw_GBps is None and cost.large is None:
        return cal
    comm = {key: replace(fit, regimes=_floored_regimes(fit, cost)) for key, fit in cal.comm.items()}
    return replace(cal, comm=comm)
