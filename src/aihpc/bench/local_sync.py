"""What one collective costs when a training step issues it between computations, on this host.

`aihpc bench comm` times collectives back to back: the ranks stay in lockstep and each call
pays only the transport's latency. A training rank computes between calls (tensor parallelism:
a gather or reduction between every pair of GEMMs), so every call also waits for the slowest
rank to arrive; on a CPU host, where gloo runs on the cores that compute and other processes
share them, that wait is most of the cost. Measured on the 2-core CI host under load (2 ranks,
gloo, a 256 KiB all-gather after four 512x256x704 GEMMs): 1.7 ms a call back to back, 9.8 ms
more a call when issued between the GEMMs (benchmarks/results/predicted_vs_measured.md).

``interleaved_call_latency_us`` measures it: N local gloo ranks run k steps of (compute chunk,
small all-gather) and k steps of the compute chunk alone; the difference per call, best of a few
repeats, is the per-call latency `aihpc calibrate --local` gives every collective's fit (the
latency a call pays at least: the back-to-back fit stays where it is larger).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from aihpc.spec.calibration import Calibration, CommFit

__all__ = ["interleaved_call_latency_us", "with_call_latency"]

_CALLS = 12
_REPEATS = 3


def _worker(rank: int, nproc: int, init: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=nproc)
    a, b = torch.randn(512, 256), torch.randn(256, 704)  # one tiny-model FFN GEMM
    x = torch.randn(1024)
    gathered = torch.empty(nproc * x.numel())

    def loop(collective: bool) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(_CALLS):
            for _ in range(4):
                torch.matmul(a, b)
            if collective:
                dist.all_gather_into_tensor(gathered, x)
        return (time.perf_counter() - t0) / _CALLS

    best_both = best_comp = float("inf")
    for _ in range(_REPEATS):
        best_comp = min(best_comp, loop(False))
        best_both = min(best_both, loop(True))
    if rank == 0:
        Path(out).write_text(f"{max(0.0, best_both - best_comp) * 1e6:.3f}")
    dist.destroy_process_group()


def interleaved_call_latency_us(nproc: int) -> float:
    """Extra microseconds one small all-gather costs when issued between computations, on
    ``nproc`` local gloo ranks of one thread each (0 for one rank)."""
    if nproc <= 1:
        return 0.0
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="aihpc-sync-") as tmp:
        init = "file://" + os.path.join(tmp, "store")
        out = os.path.join(tmp, "latency")
        mp.spawn(_worker, args=(nproc, init, out), nprocs=nproc, join=True)
        return float(Path(out).read_text())


def with_call_latency(cal: Calibration, latency_us: float) -> Calibration:
    """The calibration with every collective regime's latency raised to at least
    ``latency_us`` (what a call costs inside a training step)."""
    if latency_us <= 0:
        return cal
    comm: dict[Any, CommFit] = {}
    for key, fit in cal.comm.items():
        regimes = tuple(replace(r, latency_us=max(r.latency_us, latency_us)) for r in fit.regimes)
        comm[key] = replace(fit, regimes=regimes)
    return replace(cal, comm=comm)
