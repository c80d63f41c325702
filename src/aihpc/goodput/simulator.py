"""Discrete-event Monte Carlo simulation of training under failures, checkpoints and restarts.

It plays the process that ``goodput.ettr`` describes in closed form, on a timeline with random
failure times, so that the two can check each other (tests/goodput/test_goodput_sim.py):

- A *run* starts after a restart at a fresh durable save. It computes ``τ``, blocks ``C`` to
  take a save, computes the next ``τ``, ... Save ``k`` (k ≥ 1) is taken at k(τ+C) after the start
  and becomes durable ``W`` later. Between two interruptions the timeline is deterministic, so
  the simulator steps from one interruption to the next and counts the saves in between.
- Unexpected failures arrive with exponential inter-arrival times of mean M (or Weibull with
  the same mean, to test that assumption). A failure at time
  s into a run keeps the work of the durable saves, k·τ with k = ⌊(s − W)/(τ + C)⌋, and loses
  the rest; recovery then takes R, restarting from zero if another failure strikes during it.
- Planned interruptions arrive at rate λp during non-planned time. During a run they save all
  work done (a drain save) and pause P; during a recovery they pause it for P.

The result records the wall time spent in each state, so the lost time can be attributed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from aihpc.goodput.ettr import GoodputParams

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
    weibull_shape: float = 1.0,
    recovery_mix: Sequence[tuple[float, float]] | None = None,
) -> SimResult:
    """Simulate until ``horizon_s`` of wall time (default: ``num_failures`` x MTBF).

    ``weibull_shape``: time between failures is Weibull with this shape and mean MTBF; 1 is
    exponential (what the analytic model assumes); field studies of HPC systems fit shapes of
    0.7-0.8 (Schroeder & Gibson, DSN 2006), i.e. failures that cluster.

    ``recovery_mix``: [(weight, R)]: each failure draws its recovery time R with probability
    ∝ weight (failures of several kinds, recovered along different paths); None: R = recovery_s.
    """
    if interval_s < p.persist_s:
        raise ValueError("interval_s must be ≥ persist_s (a save waits for the previous one)")
    if not weibull_shape > 0:
        raise ValueError("weibull_shape must be > 0")
    horizon = horizon_s if horizon_s is not None else num_failures * p.mtbf_s
    if not math.isfinite(horizon):
        raise ValueError("give horizon_s when there are no failures")
    sim = _Timeline(p, interval_s, horizon, random.Random(seed), weibull_shape, recovery_mix)
    while sim.t < horizon:
        stop = sim.run()
        if stop == "horizon":
            break
        if stop == "failure":
            sim.recover()
    return SimResult(
        sim.t, sim.useful, sim.lost, sim.ckpt, sim.rec, sim.planned_t, sim.failures, sim.planned
    )


class _Timeline:
    """The simulated job's clock, its next failure and planned stop, and the time per state."""

    def __init__(
        self,
        p: GoodputParams,
        interval_s: float,
        horizon: float,
        rng: random.Random,
        weibull_shape: float,
        recovery_mix: Sequence[tuple[float, float]] | None,
    ) -> None:
        self.p, self.tau, self.horizon, self.rng = p, interval_s, horizon, rng
        self.shape = weibull_shape
        self.scale = p.mtbf_s / math.gamma(1.0 + 1.0 / weibull_shape)
        self.weights = [w for w, _ in recovery_mix] if recovery_mix else None
        self.times = [r for _, r in recovery_mix] if recovery_mix else None
        self.t = self.useful = self.lost = self.ckpt = self.rec = self.planned_t = 0.0
        self.failures = self.planned = 0
        self.fail_at, self.plan_at = self.next_failure(0.0), self.next_planned(0.0)

    def next_failure(self, now: float) -> float:
        if not math.isfinite(self.p.mtbf_s):
            return math.inf
        return now + self.rng.weibullvariate(self.scale, self.shape)

    def next_planned(self, now: float) -> float:
        lam = self.p.planned_rate_per_s
        return now + self.rng.expovariate(lam) if lam > 0 else math.inf

    def recovery_time(self) -> float:
        if self.times is None:
            return self.p.recovery_s
        return self.rng.choices(self.times, self.weights)[0]

    def pause(self) -> None:
        """A planned stop at ``plan_at``: P of downtime, during which no failure arrives."""
        self.planned += 1
        self.planned_t += self.p.planned_cost_s
        self.fail_at += self.p.planned_cost_s

    def run(self) -> str:
        """A run from a fresh durable save, until what stopped it: horizon | planned | failure."""
        p = self.p
        end = min(self.fail_at, self.plan_at, self.horizon)
        durable, compute, blocking = _run_segment(end - self.t, self.tau, p.blocking_s, p.persist_s)
        self.ckpt += blocking
        self.t = end
        if self.horizon < min(self.fail_at, self.plan_at):
            self.useful += durable
            self.lost += compute - durable  # unfinished work at the end counts as not done
            return "horizon"
        if self.plan_at < self.fail_at:  # drain: all computed work becomes durable, pause P
            self.useful += compute
            self.pause()
            self.t += p.planned_cost_s
            self.plan_at = self.next_planned(self.t)
            return "planned"
        self.useful += durable
        self.lost += compute - durable
        self.failures += 1
        self.fail_at = self.next_failure(self.t)
        return "failure"

    def recover(self) -> None:
        """R of exposed time after a failure; a failure restarts it, a planned stop pauses it."""
        done_at = self.t + self.recovery_time()
        while self.t < self.horizon:
            if not self.p.failures_during_recovery and self.fail_at < done_at:
                self.fail_at = self.next_failure(done_at)  # failures restart after recovery
            if done_at <= min(self.fail_at, self.plan_at):
                self.rec += done_at - self.t
                self.t = done_at
                return
            if self.fail_at < self.plan_at:
                self.rec += self.fail_at - self.t
                self.t = self.fail_at
                self.failures += 1
                self.fail_at = self.next_failure(self.t)
                done_at = self.t + self.recovery_time()
            else:
                self.rec += self.plan_at - self.t
                left = done_at - self.plan_at
                self.t = self.plan_at + self.p.planned_cost_s
                self.pause()
                done_at = self.t + left
                self.plan_at = self.next_planned(self.t)
