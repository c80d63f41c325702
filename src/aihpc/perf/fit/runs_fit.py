"""Fit the model's few efficiency constants to a user's measured runs (``aihpc calibrate --runs``).

What is fitted: one multiplier per efficiency the calibration file can scale
(``EFFICIENCY_SCALES``: GEMM, fused attention, scale-up and scale-out bus bandwidth), shared by
every run; never a factor per run. Each run's plan is completed once (as ``aihpc validate`` does:
the best searched completion of the cells left empty, at the uncalibrated constants) and held
fixed while the multipliers move.

How: the mean absolute log error of predicted against measured tokens/s/GPU (close to the MAPE it
reports, and robust to a run the model misses for a reason no constant explains) is minimised
over log-multipliers within ``SCALE_BOUNDS`` by Levenberg-Marquardt steps on iteratively
reweighted least squares (weights 1 / |residual|), each step accepted only when the error falls:
numpy only, a few dozen estimates per run. A constant the runs do not exercise (its multiplier
moves no prediction) stays at 1 and is reported so.

Over-fitting shows in the leave-one-out error: each run predicted by a fit to all the others
(the better of the fits started from the full fit's multipliers and from the defaults), next to
the error of the fit on every run; ``RunsFit.beats_default`` compares it with the default
constants' error on the same runs (``aihpc calibrate --runs`` warns when it does not).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from aihpc.perf.fit.runs_csv import RUNS_COLUMNS, read_table, row_runspec
from aihpc.perf.fit.validate import _checked, predict_row
from aihpc.perf.step.estimate import step_terms, tokens_per_s_per_gpu
from aihpc.runspec.calibration import EFFICIENCY_SCALES, Calibration, EfficiencyScales
from aihpc.runspec.errors import SpecError
from aihpc.runspec.parallel import ParallelPlan
from aihpc.runspec.runspec import RunSpec

__all__ = ["SCALE_BOUNDS", "RunCase", "RunsFit", "fit_runs", "load_runs", "parse_fit_names"]

# Multipliers stay within these (a fit that ends on one says so): beyond them a run fact is
# wrong, not a constant. GEMMs: the catalog's large-GEMM figures are 0.6-0.8 of the peak, so
# 0.5-1.5 spans half of that to the peak (applied efficiencies are capped at 1). Attention: the
# catalog's kernels are 0.35-0.75 of the peak and the constant for parts without one 0.5, so
# 0.5-2. Bus bandwidth: 0.8 and 0.85 of the link; x1.5 reaches the 1.2-1.3 of the link an
# all-reduce shows with in-network reduction (NVLS, SHARP: nccl-tests doc/PERFORMANCE.md) and
# a quarter is a congested or misconfigured fabric.
SCALE_BOUNDS = {
    "gemm": (0.5, 1.5),
    "attention": (0.5, 2.0),
    "scale_up": (0.25, 1.5),
    "scale_out": (0.25, 1.5),
}
# A constant is exercised when a 1% change of it moves some run's prediction by at least
# this many percent (0.01: a 1% change moves it by 0.01%, a term of about 1% of the step).
MIN_SENSITIVITY = 0.01
_STEP = math.log(1.05)  # finite-difference step in log-multiplier


@dataclass(frozen=True)
class RunCase:
    """One measured run with its plan fixed: what the fit prices again and again."""

    id: str
    spec: RunSpec
    plan: ParallelPlan
    measured: float  # tokens/s/GPU
    searched: bool  # the plan's empty cells were completed by the search


def load_runs(path: Path, progress: Callable[[str], None] | None = None) -> list[RunCase]:
    """The runs of a runs CSV, each with its plan completed; bad cells are one-line errors."""
    cases = []
    for row in read_table(path, RUNS_COLUMNS, "runs CSV"):
        if progress is not None:
            progress(row["id"])
        cases.append(_checked(path, row, lambda row=row: _case(row)))
    return cases


def _case(row: dict[str, str]) -> RunCase:
    done = predict_row(row)
    return RunCase(done.id, row_runspec(row), done.plan, done.measured, done.searched)


def parse_fit_names(text: str | None) -> tuple[str, ...]:
    """``--fit gemm,scale_out`` -> the constants to fit (default: all of them)."""
    if text is None:
        return EFFICIENCY_SCALES
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in EFFICIENCY_SCALES]
    if bad or not names:
        raise SpecError("--fit", text, "a comma list of: " + ", ".join(EFFICIENCY_SCALES))
    return tuple(n for n in EFFICIENCY_SCALES if n in names)


def predict(cases: list[RunCase], scales: dict[str, float]) -> np.ndarray:
    """Predicted tokens/s/GPU of each run with the efficiencies multiplied by ``scales``."""
    cal = Calibration(efficiency=EfficiencyScales(**scales), source="aihpc calibrate --runs")
    out = np.empty(len(cases))
    for i, c in enumerate(cases):
        cluster = replace(c.spec.cluster, calibration=cal)
        # the step time alone (estimate_plan's, without the memory the fit does not use)
        _, step = step_terms(c.spec.model, cluster, c.plan, c.spec.training)
        out[i] = tokens_per_s_per_gpu(c.spec.model, cluster, c.plan, step)
    return out


def _mape(pred: np.ndarray, measured: np.ndarray) -> float:
    return float(np.mean(np.abs(pred / measured - 1))) if len(pred) else math.nan


@dataclass(frozen=True)
class RunsFit:
    names: tuple[str, ...]  # constants fitted
    not_exercised: tuple[str, ...]  # asked for, but no run's prediction moves with them: left at 1
    scales: dict[str, float]  # every EFFICIENCY_SCALES multiplier (1 where not fitted)
    sensitivity: dict[str, float]  # max |d log prediction / d log multiplier| over the runs
    cases: list[RunCase]
    default: np.ndarray  # predictions at the uncalibrated constants
    fitted: np.ndarray  # with the fitted multipliers
    loo: np.ndarray  # each run by a fit to all the others

    @property
    def at_bound(self) -> list[str]:
        """Fitted constants that ended on a bound of SCALE_BOUNDS: the runs want more."""
        return [
            n for n in self.names if any(math.isclose(self.scales[n], b) for b in SCALE_BOUNDS[n])
        ]

    @property
    def measured(self) -> np.ndarray:
        return np.array([c.measured for c in self.cases])

    @property
    def default_mape(self) -> float:
        return _mape(self.default, self.measured)

    @property
    def fitted_mape(self) -> float:
        return _mape(self.fitted, self.measured)

    @property
    def loo_mape(self) -> float:
        return _mape(self.loo, self.measured)

    @property
    def beats_default(self) -> bool:
        """The fit predicts these runs better out of sample (leave-one-out) than the default
        constants do. The fitted error always does (the fit starts from the defaults), so it
        says nothing; a leave-one-out error at or above the defaults' says the multipliers
        follow these runs' noise and would price a new run worse than no calibration."""
        return self.loo_mape < self.default_mape

    def calibration(self, source: str) -> Calibration:
        eff = EfficiencyScales(
            **self.scales,
            num_runs=len(self.cases),
            fitted_mape=self.fitted_mape,
            loo_mape=self.loo_mape,
        )
        return Calibration(efficiency=eff, source=source)

    def check(self, cases: list[RunCase]) -> dict[str, Any]:
        """Runs the fit never saw: their error at the default constants and with the fit."""
        measured = np.array([c.measured for c in cases])
        default = predict(cases, dict.fromkeys(EFFICIENCY_SCALES, 1.0))
        fitted = predict(cases, self.scales)
        return {
            "num_runs": len(cases),
            "default_mape": _mape(default, measured),
            "calibrated_mape": _mape(fitted, measured),
            "rows": [
                {
                    "id": c.id,
                    "measured_tokens_per_s_per_gpu": c.measured,
                    "default_error": float(d / c.measured - 1),
                    "calibrated_error": float(f / c.measured - 1),
                }
                for c, d, f in zip(cases, default, fitted, strict=True)
            ],
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "num_runs": len(self.cases),
            "fitted": list(self.names),
            "not_exercised": list(self.not_exercised),
            "scales": self.scales,
            "sensitivity": self.sensitivity,
            "bounds": {n: list(b) for n, b in SCALE_BOUNDS.items()},
            "at_bound": self.at_bound,
            "default_mape": self.default_mape,
            "fitted_mape": self.fitted_mape,
            "loo_mape": self.loo_mape,
            "loo_beats_default": self.beats_default,
            "rows": [
                {
                    "id": c.id,
                    "measured_tokens_per_s_per_gpu": c.measured,
                    "searched": c.searched,
                    "default_error": float(d / c.measured - 1),
                    "fitted_error": float(f / c.measured - 1),
                    "loo_error": float(v / c.measured - 1),
                }
                for c, d, f, v in zip(self.cases, self.default, self.fitted, self.loo, strict=True)
            ],
        }


def _residuals(cases: list[RunCase], names: tuple[str, ...]) -> Callable[[np.ndarray], np.ndarray]:
    """log(predicted / measured) of every run as a function of the log-multipliers of ``names``."""
    log_measured = np.log([c.measured for c in cases])

    def resid(x: np.ndarray) -> np.ndarray:
        scales = dict.fromkeys(EFFICIENCY_SCALES, 1.0)
        scales.update({n: math.exp(v) for n, v in zip(names, x, strict=True)})
        return np.log(predict(cases, scales)) - log_measured

    return resid


Residuals = Callable[[np.ndarray], np.ndarray]


def _bounds(names: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Lower and upper bounds of the log-multipliers of ``names``."""
    lo = np.log([SCALE_BOUNDS[n][0] for n in names])
    hi = np.log([SCALE_BOUNDS[n][1] for n in names])
    return lo, hi


def _jacobian(resid: Residuals, x: np.ndarray, r: np.ndarray, hi: np.ndarray) -> np.ndarray:
    jac = np.empty((len(r), len(x)))
    for k in range(len(x)):
        step = _STEP if x[k] + _STEP <= hi[k] else -_STEP  # stay inside the bounds
        xk = x.copy()
        xk[k] += step
        jac[:, k] = (resid(xk) - r) / step
    return jac


def _minimise(
    resid: Residuals, x0: np.ndarray, names: tuple[str, ...], max_iter: int = 30
) -> np.ndarray:
    """Bounded Levenberg-Marquardt on reweighted least squares: minimises mean |resid(x)|.
    Stops when a step gains less than 1e-5 of mean |log error| (0.001 percentage points)."""
    lo, hi = _bounds(names)
    x = np.clip(x0, lo, hi)
    r = resid(x)
    cost = float(np.mean(np.abs(r)))
    damping = 1e-2
    for _ in range(max_iter):
        jac = _jacobian(resid, x, r, hi)
        w = 1.0 / np.maximum(np.abs(r), 1e-3)  # IRLS weights: least squares -> least |r|
        a = jac.T @ (w[:, None] * jac)
        g = jac.T @ (w * r)
        moved = False
        for _ in range(8):
            lhs = a + damping * np.diag(np.diag(a) + 1e-9)
            x_new = np.clip(x - np.linalg.solve(lhs, g), lo, hi)
            r_new = resid(x_new)
            cost_new = float(np.mean(np.abs(r_new)))
            if cost_new < cost - 1e-9:
                moved = cost - cost_new > 1e-5
                x, r, cost = x_new, r_new, cost_new
                damping = max(damping / 3, 1e-7)
                break
            damping *= 4
        if not moved:
            break
    return x


def _best_start(
    resid: Residuals, starts: tuple[np.ndarray, ...], names: tuple[str, ...]
) -> np.ndarray:
    """The best of the fits from each start: the mean |log error| is not convex in the
    multipliers (a collective that hides behind a GEMM up to a point has a kink there), so a
    fit to all runs but one may stop in another valley than the one it starts in."""
    fits = [_minimise(resid, x0, names) for x0 in starts]
    return min(fits, key=lambda x: float(np.mean(np.abs(resid(x)))))


def _sensitivity(cases: list[RunCase], names: tuple[str, ...]) -> dict[str, float]:
    resid = _residuals(cases, names)
    x0 = np.zeros(len(names))
    jac = _jacobian(resid, x0, resid(x0), _bounds(names)[1])
    return {n: float(np.max(np.abs(jac[:, k]))) for k, n in enumerate(names)}


def fit_runs(
    cases: list[RunCase],
    names: tuple[str, ...] = EFFICIENCY_SCALES,
    progress: Callable[[str], None] | None = None,
) -> RunsFit:
    """Fit the multipliers of ``names`` to the runs; leave-one-out predictions beside."""
    sensitivity = _sensitivity(cases, names)
    active = tuple(n for n in names if sensitivity[n] >= MIN_SENSITIVITY)
    if len(cases) < len(active) + 1:
        raise SpecError(
            "--runs",
            f"{len(cases)} runs",
            f"fitting {len(active)} constants ({', '.join(active)}) and checking each run on a "
            f"fit to the others needs at least {len(active) + 1} runs; give more runs or fewer "
            "constants with --fit",
        )
    zero = np.zeros(len(active))
    x = _minimise(_residuals(cases, active), zero, active) if active else zero
    scales = dict.fromkeys(EFFICIENCY_SCALES, 1.0)
    scales.update({n: math.exp(v) for n, v in zip(active, x, strict=True)})
    loo = np.empty(len(cases))
    for i, case in enumerate(cases):
        if progress is not None:
            progress(case.id)
        rest = cases[:i] + cases[i + 1 :]
        xi = _best_start(_residuals(rest, active), (x, zero), active) if active else x
        held = dict(scales, **{n: math.exp(v) for n, v in zip(active, xi, strict=True)})
        loo[i] = predict([case], held)[0]
    return RunsFit(
        names=active,
        not_exercised=tuple(n for n in names if n not in active),
        scales=scales,
        sensitivity=sensitivity,
        cases=cases,
        default=predict(cases, dict.fromkeys(EFFICIENCY_SCALES, 1.0)),
        fitted=predict(cases, scales),
        loo=loo,
    )


def summary_line(fit: RunsFit) -> str:
    """One line: the three errors side by side."""
    return (
        f"{len(fit.cases)} runs: MAPE {fit.default_mape:.1%} at the default constants, "
        f"{fit.fitted_mape:.1%} fitted, {fit.loo_mape:.1%} leave-one-out"
    )
