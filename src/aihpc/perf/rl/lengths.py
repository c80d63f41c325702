"""Response lengths and how an engine schedules them: the long tail of an RL rollout.

A rollout step is done when its longest response is: with continuous batching the engine keeps
``slots`` sequences running (as many as its KV cache holds), admits the next as one finishes, and
the last iterations run a few long responses alone. ``schedule`` gives, per decode iteration,
the sequences running and the tokens their KV caches hold, from which rollout.py prices each
iteration.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Schedule", "response_lengths", "schedule"]


def _exp_scale(mean: float, cap: float) -> float:
    """The scale θ of an exponential cut at ``cap`` whose mean θ(1 - e^(-cap/θ)) is ``mean``."""
    lo, hi = math.log(cap * 1e-6), math.log(cap * 1e6)
    for _ in range(100):
        mid = (lo + hi) / 2
        theta = math.exp(mid)
        if theta * -math.expm1(-cap / theta) < mean:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2)


def response_lengths(n: int, mean: int, cap: int, dist: str) -> np.ndarray:
    """``n`` response lengths (tokens) at the distribution's evenly spaced quantiles, in an
    order that mixes long and short (the order requests reach an engine is arbitrary)."""
    q = (np.arange(n) + 0.5) / n
    if dist == "fixed" or mean >= cap:
        out = np.full(n, float(mean))
    elif dist == "uniform":
        half = min(mean, cap - mean)
        out = mean - half + 2 * half * q
    else:  # capped_exponential
        theta = _exp_scale(mean, cap)
        out = np.minimum(cap, -theta * np.log1p(-q))
    lengths = np.maximum(1, np.rint(out)).astype(np.int64)
    order = np.argsort((np.arange(n) * 0.6180339887) % 1.0, kind="stable")
    return lengths[order]


@dataclass(frozen=True)
class Schedule:
    """Per decode iteration t: ``running[t]`` sequences, ``progress[t]`` response tokens their
    KV caches hold in all (each running sequence also holds its prompt)."""

    running: np.ndarray
    progress: np.ndarray

    @property
    def iterations(self) -> int:
        return len(self.running)


def schedule(lengths: np.ndarray, slots: int) -> Schedule:
    """Continuous batching of ``lengths`` on ``slots`` (>= 1): list scheduling in arrival
    order; a sequence occupies its slot for as many iterations as it has tokens."""
    n = len(lengths)
    if slots >= n:
        starts = np.zeros(n, dtype=np.int64)
    else:
        free = [0] * slots
        starts = np.empty(n, dtype=np.int64)
        for i, length in enumerate(lengths.tolist()):
            start = heapq.heappop(free)
            starts[i] = start
            heapq.heappush(free, start + length)
    ends = starts + lengths
    horizon = int(ends.max())
    running = np.zeros(horizon + 1, dtype=np.float64)
    start_sum = np.zeros(horizon + 1, dtype=np.float64)
    np.add.at(running, starts, 1.0)
    np.add.at(running, ends, -1.0)
    np.add.at(start_sum, starts, starts.astype(np.float64))
    np.add.at(start_sum, ends, -starts.astype(np.float64))
    running, start_sum = np.cumsum(running)[:-1], np.cumsum(start_sum)[:-1]
    t = np.arange(horizon, dtype=np.float64)
    progress = running * t - start_sum  # each running sequence has generated t - start tokens
    return Schedule(running, progress)
