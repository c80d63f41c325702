"""Goodput at scale: the effective-training-time ratio (ETTR) under failures, checkpoints and
restarts, the optimal checkpoint interval, and time-to-train.

The process (the simulator in ``simulator.py`` implements the same one, event by event):
training computes for ``τ`` seconds, then pauses ``C`` (blocking part of a save); the save
becomes durable ``W`` seconds later (async persist; 0 for sync), while the next interval runs.
Unexpected failures arrive as a Poisson process of rate λ = 1/M. A failure rolls training back
to the last *durable* save (so a failure during the persist window loses two intervals) and
costs ``R`` = detection + restart + load, during which further failures may strike (each
restarts the recovery). Planned interruptions (rate λp) drain a final save first, lose no work
and cost ``P`` = C + W + restart + load.

Exact ETTR (renewal argument between consecutive durable saves, exponential failures, τ ≥ W)::

    L = τ + C            exposed time from one durable save to the next, no failure
    L' = τ + C + W       the same after a restart (nothing of the next interval is done yet)
    T2 = (e^{λ(R+L')} − 1)/λ                 failure → next durable save (recovery exposed)
         R + (e^{λL'} − 1)(1/λ + R)          (failures_during_recovery = False)
    T1 = (1 − e^{−λL}) (1/λ + T2)           expected time between durable saves
    ETTR = τ / T1 / (1 + λp·P)

With W = 0 this is Daly's expression e^{λR}(e^{λ(τ+C)} − 1)/λ (Daly 2006, FGCS 22, eq. 13).
Intervals: Young (1974, CACM 17(9)) τ = √(2CM); Daly (2006, eq. 37) higher order
τ = √(2CM)[1 + ⅓√(C/2M) + (C/2M)/9] − C for C < 2M, else M; and the exact optimum of the
expression above, found numerically.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from aihpc.goodput.failures import (
    DAY_S,
    CheckpointCost,
    FailureModel,
    RecoveryCost,
    checkpoint_cost,
    failure_model,
    recovery_cost,
)
from aihpc.runspec.errors import SpecError
from aihpc.runspec.runspec import RunSpec

__all__ = [
    "LOSS_NAMES",
    "GoodputModel",
    "GoodputParams",
    "GoodputReport",
    "daly_interval_s",
    "ettr",
    "ettr_of_step_time",
    "goodput_model",
    "goodput_report",
    "lost_time_fractions",
    "maximise_on_log_scale",
    "optimal_interval_s",
    "whole_step_interval_s",
    "young_interval_s",
]

DEFAULT_DAYS = 30.0
LOSS_NAMES = {
    "checkpoint": "checkpoint stalls",
    "lost_work": "recomputing work lost since the last durable checkpoint",
    "recovery": "recovery (detection + restart + checkpoint load)",
    "planned": "planned maintenance",
}


@dataclass(frozen=True)
class GoodputParams:
    """The numbers the ETTR expression and the simulator need (seconds, per second)."""

    mtbf_s: float  # unexpected failures of the whole job
    blocking_s: float  # C
    persist_s: float  # W
    recovery_s: float  # R
    planned_rate_per_s: float = 0.0  # λp
    planned_cost_s: float = 0.0  # P
    failures_during_recovery: bool = True

    @property
    def min_interval_s(self) -> float:
        """A save cannot start before the previous one is durable: τ ≥ W."""
        return self.persist_s


def _check_interval(p: GoodputParams, interval_s: float) -> None:
    if not interval_s > 0 or interval_s < p.min_interval_s * (1 - 1e-12):
        raise SpecError(
            "reliability.checkpoint_interval_s",
            interval_s,
            f"must be > 0 and ≥ the background persist time {p.persist_s:.3g} s "
            "(a save cannot start before the previous one is durable)",
        )


def _one_minus_exp_neg_over(lam: float, x: float) -> float:
    """(1 − e^{−λx})/λ, → x as λ → 0."""
    return x if lam * x < 1e-12 else -math.expm1(-lam * x) / lam


def expected_cycle_s(p: GoodputParams, interval_s: float) -> float:
    """T1: expected wall time between two durable saves (one interval of useful work)."""
    lam = 1.0 / p.mtbf_s if math.isfinite(p.mtbf_s) else 0.0
    L = interval_s + p.blocking_s
    Lp = L + p.persist_s
    R = p.recovery_s
    if lam == 0.0:
        return L
    try:
        if p.failures_during_recovery:
            inv_plus_t2 = math.exp(lam * (R + Lp)) / lam
        else:
            inv_plus_t2 = 1.0 / lam + R + math.expm1(lam * Lp) * (1.0 / lam + R)
    except OverflowError:
        return math.inf
    return _one_minus_exp_neg_over(lam, L) * lam * inv_plus_t2


def ettr(p: GoodputParams, interval_s: float) -> float:
    """Expected fraction of wall-clock time that is useful training (exact, see module doc)."""
    _check_interval(p, interval_s)
    planned = 1.0 + p.planned_rate_per_s * p.planned_cost_s
    if math.isinf(interval_s):  # never checkpoint: fine only when nothing ever fails
        return 0.0 if math.isfinite(p.mtbf_s) else 1.0 / planned
    return interval_s / expected_cycle_s(p, interval_s) / planned


def young_interval_s(blocking_s: float, mtbf_s: float) -> float:
    """Young (1974): τ = √(2·C·M)."""
    return math.sqrt(2.0 * blocking_s * mtbf_s)


def daly_interval_s(blocking_s: float, mtbf_s: float) -> float:
    """Daly (2006) eq. 37, the higher-order estimate of the optimum compute interval."""
    if blocking_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = blocking_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * blocking_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - blocking_s


def optimal_interval_s(p: GoodputParams) -> float:
    """The interval τ ≥ W that maximises ``ettr`` (log grid, then golden-section refinement)."""
    if not math.isfinite(p.mtbf_s):
        return math.inf
    lo = max(p.min_interval_s, 1e-6 * p.mtbf_s, 1e-3)
    return maximise_on_log_scale(lambda t: ettr(p, t), lo, max(20.0 * p.mtbf_s, 10.0 * lo))


def maximise_on_log_scale(f: Callable[[float], float], lo: float, hi: float) -> float:
    """The x in [lo, hi] that maximises a unimodal ``f``: a 200-point log grid, then
    golden-section search on log x between the grid neighbours of the best point."""
    n = 200
    grid = [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]
    vals = [f(t) for t in grid]
    i = max(range(n), key=vals.__getitem__)
    a, b = math.log(grid[max(i - 1, 0)]), math.log(grid[min(i + 1, n - 1)])
    g = (math.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(math.exp(c)), f(math.exp(d))
    for _ in range(60):
        if fc >= fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(math.exp(c))
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(math.exp(d))
    return math.exp((a + b) / 2)


def whole_step_interval_s(p: GoodputParams, optimum_s: float, step_time_s: float) -> float:
    """The best interval that is a whole number of steps (saves happen between steps): the
    better of the two multiples around the optimum, at least one step and at least W. This is
    what makes ETTR depend on the plan: a plan whose step is long next to the optimal interval
    checkpoints less often than it should."""
    if not math.isfinite(optimum_s):
        return optimum_s
    k_min = max(1, math.ceil(p.min_interval_s / step_time_s - 1e-9))
    k = optimum_s / step_time_s
    candidates = {max(k_min, math.floor(k)), max(k_min, math.ceil(k))}
    return max((c * step_time_s for c in candidates), key=lambda t: ettr(p, t))


def lost_time_fractions(p: GoodputParams, interval_s: float) -> dict[str, float]:
    """Where the lost wall time (1 − ETTR) goes: first-order shares, scaled to sum to 1 − ETTR.

    checkpoint C/(τ+C); lost work λ((τ+C)/2 + W); recovery λR; planned λp·P.
    """
    lam = 1.0 / p.mtbf_s if math.isfinite(p.mtbf_s) else 0.0
    raw = {
        "checkpoint": p.blocking_s / (interval_s + p.blocking_s) if interval_s > 0 else 1.0,
        "lost_work": lam * ((interval_s + p.blocking_s) / 2 + p.persist_s) if lam else 0.0,
        "recovery": lam * p.recovery_s,
        "planned": p.planned_rate_per_s * p.planned_cost_s,
    }
    total = sum(raw.values())
    lost = 1.0 - ettr(p, interval_s)
    return {k: (v / total * lost if total > 0 else 0.0) for k, v in raw.items()}


@dataclass(frozen=True)
class GoodputModel:
    """Everything the goodput figures are computed from, for one run spec."""

    failures: FailureModel
    checkpoint: CheckpointCost
    recovery: RecoveryCost
    params: GoodputParams


def goodput_model(spec: RunSpec, checkpoint_bytes: float | None = None) -> GoodputModel:
    """Failure rates, checkpoint cost and recovery time of ``spec`` (checkpoint size from the
    memory model unless given)."""
    if checkpoint_bytes is None:
        from aihpc.perf.step.memory import checkpoint_bytes as _ckpt_bytes

        checkpoint_bytes = _ckpt_bytes(spec.model, spec.training)
    fm = failure_model(spec.cluster, spec.reliability)
    ck = checkpoint_cost(spec, checkpoint_bytes)
    rc = recovery_cost(spec.reliability, ck.load_s)
    planned_cost = ck.blocking_s + ck.persist_s + rc.restart_s + rc.load_s
    params = GoodputParams(
        mtbf_s=fm.mtbf_s,
        blocking_s=ck.blocking_s,
        persist_s=ck.persist_s,
        recovery_s=rc.total_s,
        planned_rate_per_s=fm.planned_rate_per_s,
        planned_cost_s=planned_cost,
        failures_during_recovery=spec.reliability.failures_during_recovery,
    )
    return GoodputModel(fm, ck, rc, params)


@dataclass(frozen=True)
class GoodputReport:
    """Goodput figures of one run spec at one step time."""

    model: GoodputModel
    step_time_s: float
    tokens_per_step: float
    days: float
    tokens: float | None
    checkpoint_interval_s: float  # used: [reliability] override, else the best whole-step one
    optimal_checkpoint_interval_s: float
    ettr: float

    @property
    def num_gpus(self) -> int:
        return self.model.failures.num_gpus

    @property
    def mtbf_s(self) -> float:
        return self.model.failures.mtbf_s

    @property
    def interruptions_per_day(self) -> float:
        fm = self.model.failures
        return (fm.failure_rate_per_s + fm.planned_rate_per_s) * DAY_S

    @property
    def expected_interruptions(self) -> float:
        """Unexpected + planned interruptions over ``days`` of wall-clock time."""
        return self.interruptions_per_day * self.days

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.step_time_s / self.num_gpus

    @property
    def goodput_tokens_per_s_per_gpu(self) -> float:
        """Throughput x ETTR: what ``aihpc search --rank-by goodput`` ranks by."""
        return self.tokens_per_s_per_gpu * self.ettr

    @property
    def time_to_train_days(self) -> float | None:
        if self.tokens is None:
            return None
        rate = self.tokens_per_step / self.step_time_s * self.ettr
        return self.tokens / rate / DAY_S if rate > 0 else math.inf

    @property
    def lost_time(self) -> dict[str, float]:
        return lost_time_fractions(self.model.params, self.checkpoint_interval_s)

    @property
    def dominant_loss(self) -> str:
        lost = self.lost_time
        return max(lost, key=lost.__getitem__)

    def summary(self) -> str:
        """One sentence naming what dominates the lost time."""
        lost = self.lost_time
        key = self.dominant_loss
        every_h = 24.0 / self.interruptions_per_day if self.interruptions_per_day else math.inf
        if lost[key] <= 0:
            return f"At {self.num_gpus:,} GPUs nothing is lost: no failures are modelled."
        return (
            f"At {self.num_gpus:,} GPUs the job is interrupted every {every_h:.2g} h; "
            f"{LOSS_NAMES[key]} dominates the lost time ({lost[key]:.1%} of wall-clock), "
            f"leaving ETTR {self.ettr:.1%} with {self.model.checkpoint.strategy} checkpoints "
            f"every {self.checkpoint_interval_s / 60:.3g} min."
        )

    @property
    def checkpoint_interval_steps(self) -> int | None:
        """The interval in whole steps; None when it is too long to count (an interval of 1e308 s
        on a millisecond step overflows a float)."""
        steps = self.checkpoint_interval_s / self.step_time_s
        return max(1, round(steps)) if math.isfinite(steps) else None

    def to_json(self) -> dict[str, Any]:
        m = self.model
        p = m.params
        out: dict[str, Any] = {
            "num_gpus": self.num_gpus,
            "num_nodes": m.failures.num_nodes,
            "mtbf_s": self.mtbf_s,
            "failures_per_day": {k: v * 24 for k, v in m.failures.by_category().items()},
            "planned_interruptions_per_day": m.failures.planned_per_day,
            "failure_rate_source": m.failures.source,
            "days": self.days,
            "expected_interruptions": self.expected_interruptions,
            "checkpoint": m.checkpoint.to_json(),
            "recovery": m.recovery.to_json(),
            "checkpoint_interval_s": self.checkpoint_interval_s,
            "checkpoint_interval_steps": self.checkpoint_interval_steps,
            "optimal_checkpoint_interval_s": self.optimal_checkpoint_interval_s,
            "young_interval_s": young_interval_s(p.blocking_s, p.mtbf_s),
            "daly_interval_s": daly_interval_s(p.blocking_s, p.mtbf_s),
            "ettr": self.ettr,
            "lost_time_fraction": self.lost_time,
            "dominant_loss": self.dominant_loss,
            "step_time_s": self.step_time_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "goodput_tokens_per_s_per_gpu": self.goodput_tokens_per_s_per_gpu,
            "summary": self.summary(),
        }
        if self.tokens is not None:
            out["tokens"] = self.tokens
            out["time_to_train_days"] = self.time_to_train_days
            out["gpu_hours"] = self.time_to_train_days * 24 * self.num_gpus
        return out


def _check_positive_number(field: str, value: float | None) -> None:
    if value is not None and (isinstance(value, bool) or not math.isfinite(value) or value <= 0):
        raise SpecError(field, value, "must be a finite number > 0")


def goodput_report(
    spec: RunSpec, step_time_s: float, days: float | None = None, tokens: float | None = None
) -> GoodputReport:
    """Goodput of ``spec`` running at ``step_time_s`` per optimizer step.

    ``days``: horizon for ``expected_interruptions`` (default: the time to train ``tokens`` when
    given, else 30 days). ``tokens``: a token budget, for ``time_to_train_days``.
    """
    _check_positive_number("--step-time", step_time_s)
    _check_positive_number("--days", days)
    _check_positive_number("--tokens", tokens)
    model = goodput_model(spec)
    p = model.params
    optimum = optimal_interval_s(p)
    interval = spec.reliability.checkpoint_interval_s
    if interval is None:
        interval = whole_step_interval_s(p, optimum, step_time_s)
    e = ettr(p, interval)
    gbs = spec.parallel.global_batch_size
    if gbs is None:
        raise SpecError("parallel.global_batch_size", None, "required: sequences per step")
    tokens_per_step = float(gbs * spec.model.seq_length)
    report = GoodputReport(
        model, step_time_s, tokens_per_step, days or DEFAULT_DAYS, tokens, interval, optimum, e
    )
    if days is None and tokens is not None and report.time_to_train_days is not None:
        report = replace(report, days=report.time_to_train_days)
    return report


def ettr_of_step_time(spec: RunSpec) -> Callable[[float], float]:
    """ETTR of ``spec`` as a function of its step time: what ``goodput_report(spec, t).ettr``
    gives, for ranking the thousands of plans of one search. The failure model and the optimal
    interval do not depend on the plan, so they are computed once (a search ranked by goodput
    took 4x as long as one by throughput while it built them for every plan)."""
    p = goodput_model(spec).params
    optimum = optimal_interval_s(p)
    fixed = spec.reliability.checkpoint_interval_s

    def at(step_time_s: float) -> float:
        _check_positive_number("--step-time", step_time_s)
        interval = fixed if fixed is not None else whole_step_interval_s(p, optimum, step_time_s)
        return ettr(p, interval)

    return at
