"""aihpc calibrate --runs, the library side: fitting the efficiency multipliers to measured runs.

Two checks that would catch a wrong answer: rows the model itself generated with known
multipliers give those multipliers back, and a fit on one cluster's published rows is checked on
the other clusters' rows with the leave-one-out error computed as it says (each run by a fit to
the others). The errors on real rows are whatever they are; docs/performance-model.md records
them."""

from __future__ import annotations

import csv
import dataclasses
import math
import tomllib
from pathlib import Path

import numpy as np
import pytest

from aihpc.perf.fit.runs_fit import SCALE_BOUNDS, fit_runs, load_runs, parse_fit_names, predict
from aihpc.perf.fit.validate import data_file
from aihpc.perf.step.estimate import estimate_plan
from aihpc.perf.step.gemm import gemm_efficiency
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec.calibration import (
    Calibration,
    EfficiencyScales,
    calibration_from_dict,
    calibration_to_toml,
    load_calibration,
)
from aihpc.runspec.cluster import gpu_from_id
from aihpc.runspec.errors import SpecError

# Runs that exercise every constant: long-sequence FlashAttention-2 on one node (I06), FSDP over
# 16 nodes (I04), TP 4 x PP 4 over 8 nodes (G07), TP 4 and DP 48 (D03), one node in FP8 (G05),
# TP 8 with PP 8 on A100s (B04).
MIXED = ("I06", "I04", "G07", "D03", "G05", "B04")
TRUTH = {"gemm": 0.9, "attention": 1.2, "scale_up": 0.8, "scale_out": 1.15}


def _subset(tmp: Path, name: str, keep) -> Path:
    with open(data_file("published_runs.csv"), newline="") as fh:
        reader = csv.DictReader(fh)
        rows = [r for r in reader if keep(r["id"])]
        columns = reader.fieldnames
    path = tmp / name
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> list:
    return load_runs(_subset(tmp_path_factory.mktemp("runs"), "mixed.csv", MIXED.__contains__))


def _generated(cases: list, scales: dict[str, float]) -> list:
    """The runs with their measured figure replaced by the model's own at ``scales``."""
    made = predict(cases, scales)
    return [dataclasses.replace(c, measured=float(m)) for c, m in zip(cases, made, strict=True)]


def test_fit_recovers_the_multipliers_that_generated_the_runs(mixed: list) -> None:
    fit = fit_runs(_generated(mixed, TRUTH))
    assert fit.names == ("gemm", "attention", "scale_up", "scale_out")
    for name, value in TRUTH.items():
        assert fit.scales[name] == pytest.approx(value, rel=1e-3), name
    assert fit.fitted_mape < 1e-4 and fit.loo_mape < 1e-4
    assert fit.default_mape > 0.05  # the runs were far from the default constants


def test_fit_starts_from_the_defaults_and_never_ends_worse(mixed: list) -> None:
    """On rows the model did not generate, the fitted mean |log error| is at most the default's
    (the optimiser accepts only steps that lower it), and every multiplier is within bounds."""
    fit = fit_runs(mixed)
    log_err = np.abs(np.log(fit.fitted / fit.measured)).mean()
    assert log_err <= np.abs(np.log(fit.default / fit.measured)).mean()
    for name, value in fit.scales.items():
        lo, hi = SCALE_BOUNDS[name]
        assert lo <= value <= hi


def test_constant_no_run_exercises_stays_at_one(mixed: list) -> None:
    """One-node runs do not move the network's multiplier: it is reported, not fitted."""
    one_node = [c for c in mixed if c.spec.cluster.num_gpus <= 8]
    fit = fit_runs(_generated(one_node, {**TRUTH, "scale_out": 1.0}), ("gemm", "scale_out"))
    assert fit.not_exercised == ("scale_out",) and fit.scales["scale_out"] == 1.0
    assert fit.sensitivity["scale_out"] == 0.0
    with pytest.raises(SpecError, match=r"2 runs.*needs at least \d runs"):
        fit_runs(one_node)  # every constant they exercise, from 2 runs


def test_fit_names_are_checked() -> None:
    assert parse_fit_names("scale_out, gemm") == ("gemm", "scale_out")
    with pytest.raises(SpecError, match="--fit"):
        parse_fit_names("gemm,bandwidth")


def test_fit_on_one_cluster_checked_on_the_others(tmp_path: Path) -> None:
    """Korthikanti et al.'s eight Selene runs (B01-B08) fit; the other 58 published rows check.
    The leave-one-out prediction of a run is that of a fit to the other seven, and the written
    calibration, read back, prices a run exactly as the fit did."""
    fit = fit_runs(load_runs(_subset(tmp_path, "b.csv", lambda i: i.startswith("B"))))
    assert len(fit.cases) == 8 and set(fit.names) == {"gemm", "scale_up", "scale_out"}
    assert fit.not_exercised == ("attention",)  # unfused attention: its GEMMs are gemm's
    assert np.isfinite(fit.loo).all() and not np.allclose(fit.loo, fit.fitted)
    rest = fit_runs(fit.cases[1:], fit.names)
    one = predict(fit.cases[:1], rest.scales)[0]
    assert fit.loo[0] == pytest.approx(one, rel=1e-3)  # the better start: here the defaults'
    checked = fit.check(load_runs(_subset(tmp_path, "rest.csv", lambda i: not i.startswith("B"))))
    assert checked["num_runs"] == 58
    errors = [abs(r["calibrated_error"]) for r in checked["rows"]]
    assert checked["calibrated_mape"] == pytest.approx(sum(errors) / len(errors))
    assert math.isfinite(checked["default_mape"])
    cal_file = tmp_path / "cal.toml"
    cal_file.write_text(calibration_to_toml(fit.calibration("test")))
    cal = load_calibration(cal_file)
    assert cal.efficiency is not None and cal.efficiency.num_runs == 8
    case = fit.cases[3]
    cluster = dataclasses.replace(case.spec.cluster, calibration=cal)
    est = estimate_plan(case.spec.model, cluster, case.plan, case.spec.training)
    assert est.tokens_per_s_per_gpu == pytest.approx(fit.fitted[3], rel=1e-12)


def test_efficiency_table_reads_back_and_refuses_bad_values() -> None:

    eff = EfficiencyScales(gemm=0.9, scale_out=1.2, num_runs=5, fitted_mape=0.03, loo_mape=0.05)
    text = calibration_to_toml(Calibration(efficiency=eff, source="x"))
    assert calibration_from_dict(tomllib.loads(text)).efficiency == eff
    for table, field in (({"gemm": -1.0}, "gemm"), ({"flops": 1.0}, "flops")):
        with pytest.raises(SpecError, match=f"calibration.efficiency.{field}"):
            calibration_from_dict({"efficiency": table})
    # a multiplier never lifts a GEMM past the peak
    h100 = gpu_from_id("h100-sxm")
    fast = Calibration(efficiency=EfficiencyScales(gemm=5.0))
    assert gemm_efficiency(h100, "bf16", 1e4, DEFAULT_PARAMS, fast) == 1.0
    base = gemm_efficiency(h100, "bf16", 1e4, DEFAULT_PARAMS, None)
    half = Calibration(efficiency=EfficiencyScales(gemm=0.5))
    assert gemm_efficiency(h100, "bf16", 1e4, DEFAULT_PARAMS, half) == pytest.approx(base / 2)
