"""Discrete-event Monte Carlo simulation of training under failures, checkpoints and restarts.

It plays the process that ``goodput.ettr`` describes in closed form, on a timeline with random
failure times, so that the two can check each other (tests/perf/test_goodput_sim.py):

- A *run* starts after a restart at a fresh durable save. It computes ``τ``, blocks ``C`` to
  take a save, computes the next ``τ``, ... Save ``k`` (k ≥ 1) is taken at k(τ+C) after the start
  and becomes durable ``W`` later. Between two interruptions the timeline is deterministic, so
  the simulator steps from one interruption to the next and counts the saves in between.
- Unexpected failures arrive with exponential inter-arrival times of mean M. A failure at time
  s into a run keeps the work of the durable saves, k·τ with k = ⌊(s − W)/(τ + C)⌋, and loses
  the rest; recovery then takes R, restarting from zero if another failure strikes during it.
- Planned interruptions arrive at rate λp during non-planned time. During a run they save all
  work done (a drain save) and pause P; during a recovery they pause it for P.

The result records the wall time spent in each state, so the lost time can be attributed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from aihpc.perf.goodput import GoodputParams

__all__ = ["SimResult", "simulate"]


@dataclass(frozen=True)
class SimResult:
    """Totals over the simulated horizon (seconds) and the ETTR they give."""

    wall_s: float
    useful_s: float  # work covered by a durable save (or drained at a planned stop)
    lost_work_s: float  # compute rolled back by failures
    checkpoint_s: float  # blocking time of saves
    recovery_s: float  # detection + restart + load, including recoveries cut short
    planned_s: float  # planned downtime
    failures: int
    planned: int

    @property
    def ettr(self) -> float:
        return self.useful_s / self.wall_s

    @property
    def ettr_stderr(self) -> float:
        """Rough standard error: the lost time is a sum over ~``failures`` independent cycles."""
        n = max(self.failures, 1)
        return (1.0 - self.ettr) / math.sqrt(n) * 2.0


def _run_segment(s: float, tau: float, block: float, persist: float) -> tuple[float, float, float]:
    """A run of length s from a fresh durable save: (durable work, compute done, blocking time)."""
    period = tau + block
    full = math.floor(s / period)
    rem = s - full * period
    compute = full * tau + min(rem, tau)
    blocking = s - compute
    durable = tau * max(0, math.floor((s - persist) / period)) if s >= persist else 0.0
    return durable, compute, blocking


def simulate(
    p: GoodputParams,
    interval_s: float,
    *,
    num_failures: int = 20_000,
    horizon_s: float | None = None,
    seed: int = 0,
) -> SimResult:
    """Simulate until ``horizon_s`` of wall time (default: ``num_failures`` x MTBF)."""
    if interval_s < p.persist_s:
        raise ValueError("interval_s must be ≥ persist_s (a save waits for the previous one)")
    rng = random.Random(seed)
    lam = 1.0 / p.mtbf_s if math.isfinite(p.mtbf_s) else 0.0
    lam_p = p.planned_rate_per_s
    horizon = horizon_s if horizon_s is not None else num_failures * p.mtbf_s
    if not math.isfinite(horizon):
        raise ValueError("give horizon_s when there are no failures")

    def draw(rate: float) -> float:
        return rng.expovariate(rate) if rate > 0 else math.inf

    t = useful = lost = ckpt = rec = planned_t = 0.0
    failures = planned = 0
    tau, block, persist = interval_s, p.blocking_s, p.persist_s
    while t < horizon:
        # --- a run from a fresh durable save, until the next interruption or the horizon
        x, y = draw(lam), draw(lam_p)
        left = horizon - t
        s = min(x, y, left)
        durable, compute, blocking = _run_segment(s, tau, block, persist)
        ckpt += blocking
        t += s
        if left < min(x, y):  # horizon reached
            useful += durable
            lost += compute - durable  # unfinished work at the end counts as not done
            break
        if y < x:  # planned: drain (all computed work becomes durable), pause P
            useful += compute
            planned += 1
            planned_t += p.planned_cost_s
            t += p.planned_cost_s
            continue
        useful += durable
        lost += compute - durable
        failures += 1
        # --- recovery: R of exposed time; a failure restarts it, a planned stop pauses it
        remaining = p.recovery_s
        while remaining > 0 and t < horizon:
            x = draw(lam) if p.failures_during_recovery else math.inf
            y = draw(lam_p)
            if remaining <= min(x, y):
                t += remaining
                rec += remaining
                remaining = 0.0
            elif x < y:
                t += x
                rec += x
                failures += 1
                remaining = p.recovery_s
            else:
                t += y
                rec += y
                remaining -= y
                planned += 1
                planned_t += p.planned_cost_s
                t += p.planned_cost_s
    return SimResult(t, useful, lost, ckpt, rec, planned_t, failures, planned)
