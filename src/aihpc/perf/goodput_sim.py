"""Discrete-event Monte Carlo simulation of training under failures, checkpoints and restarts.

It plays the process that ``goodput.ettr`` describes in closed form, on a timeline with random
failure times, so that the two can check each other (tests/perf/test_goodput_sim.py):

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
    rng = random.Random(seed)
    lam_p = p.planned_rate_per_s
    horizon = horizon_s if horizon_s is not None else num_failures * p.mtbf_s
    if not math.isfinite(horizon):
        raise ValueError("give horizon_s when there are no failures")
    scale = p.mtbf_s / math.gamma(1.0 + 1.0 / weibull_shape)

    def next_failure(now: float) -> float:
        if not math.isfinite(p.mtbf_s):
            return math.inf
        return now + rng.weibullvariate(scale, weibull_shape)

    weights = [w for w, _ in recovery_mix] if recovery_mix else None
    times = [r for _, r in recovery_mix] if recovery_mix else None

    def recovery_time() -> float:
        if times is None:
            return p.recovery_s
        return rng.choices(times, weights)[0]

    def next_planned(now: float) -> float:
        return now + rng.expovariate(lam_p) if lam_p > 0 else math.inf

    t = useful = lost = ckpt = rec = planned_t = 0.0
    failures = planned = 0
    tau, block, persist, pause = interval_s, p.blocking_s, p.persist_s, p.planned_cost_s
    fail_at, plan_at = next_failure(0.0), next_planned(0.0)
    while t < horizon:
        # --- a run from a fresh durable save, until the next interruption or the horizon
        end = min(fail_at, plan_at, horizon)
        durable, compute, blocking = _run_segment(end - t, tau, block, persist)
        ckpt += blocking
        t = end
        if horizon < min(fail_at, plan_at):  # horizon reached
            useful += durable
            lost += compute - durable  # unfinished work at the end counts as not done
            break
        if plan_at < fail_at:  # planned: drain (all computed work becomes durable), pause P
            useful += compute
            planned += 1
            planned_t += pause
            t += pause
            fail_at += pause  # no failures while the job is down
            plan_at = next_planned(t)
            continue
        useful += durable
        lost += compute - durable
        failures += 1
        fail_at = next_failure(t)
        # --- recovery: R of exposed time; a failure restarts it, a planned stop pauses it
        done_at = t + recovery_time()
        while t < horizon:
            if not p.failures_during_recovery and fail_at < done_at:
                fail_at = next_failure(done_at)  # the failure process restarts after recovery
            if done_at <= min(fail_at, plan_at):
                rec += done_at - t
                t = done_at
                break
            if fail_at < plan_at:
                rec += fail_at - t
                t = fail_at
                failures += 1
                fail_at = next_failure(t)
                done_at = t + recovery_time()
            else:
                rec += plan_at - t
                left = done_at - plan_at
                t = plan_at + pause
                planned += 1
                planned_t += pause
                fail_at += pause
                done_at = t + left
                plan_at = next_planned(t)
    return SimResult(t, useful, lost, ckpt, rec, planned_t, failures, planned)
