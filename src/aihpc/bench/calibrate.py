"""Fit the calibration the performance model reads, from measurements, with numpy only.

Communication: per (collective, tier), time of one operation of whole-buffer size S on n ranks is
modelled as ``t = latency + S * busbw_factor(n) / busbw`` (the alpha-beta / Hockney model written
in nccl-tests' busbw terms). One line is not enough: NCCL switches algorithm and protocol
(LL -> LL128 -> Simple, Ring -> NVLS / Tree) around 1-2 MiB, and a single fit to Azure's published
8xH100 all_reduce table misses by up to 25 % (our research notes, section 1.4). So the sizes are
split into contiguous regimes (2 by default) at the breakpoints that minimise the largest relative
error, and each regime gets its own weighted least-squares fit (weights 1/t, i.e. relative error).

GEMM: achieved TFLOP/s against GFLOP per GEMM, kept as points (the performance model interpolates
in log(GFLOP)); repeated shapes of the same size are averaged.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aihpc.bench.collectives import busbw_factor
from aihpc.bench.nccl_log import NcclTest, read_nccl_tests_log
from aihpc.runspec.calibration import TIERS, Calibration, CommFit, CommRegime, GemmFit
from aihpc.runspec.errors import SpecError
from aihpc.runspec.inputs import parse_json, read_input

__all__ = [
    "CommPoint",
    "FitReport",
    "fit_comm",
    "fit_regime",
    "fit_to_calibration",
    "gemm_points_from_json",
    "load_measurements",
    "points_from_bench_json",
    "points_from_nccl_tests",
]

# A regime's fitted busbw may exceed the best busbw measured at any size of the series (the
# measurement includes the latency the fit takes out), but not by this much: a regime whose time
# hardly grows with its sizes (a latency-bound regime, or one noisy size) fits an absurd busbw,
# 1e6 GB/s and more. Such a regime is given the best measured busbw instead (a bandwidth the link
# did reach), its latency fitted again, and the report says so.
MAX_BUSBW_OVER_MEASURED = 2.0


@dataclass(frozen=True)
class CommPoint:
    collective: str
    tier: str
    num_ranks: int
    size_bytes: float
    time_us: float
    ranks_per_domain: int = 0  # ranks of the group per node (0: unknown)


@dataclass(frozen=True)
class FitReport:
    collective: str
    tier: str
    num_ranks: int
    num_points: int
    max_rel_error: float  # of the regime fit, over every measured size
    single_regime_max_rel_error: float  # what one line would give, for comparison
    fit: CommFit
    best_measured_busbw_GBps: float = 0.0
    # (regime index, busbw the free fit gave) for regimes given the best measured busbw instead
    capped: tuple[tuple[int, float], ...] = ()


def fit_regime(
    sizes: Sequence[float],
    times_us: Sequence[float],
    factor: float,
    busbw_GBps: float | None = None,
) -> tuple[float, float]:
    """Weighted least squares ``t = lat + S*factor/busbw`` -> ``(latency_us, busbw_GBps)``.

    Minimises the sum of squared *relative* errors, with latency >= 0 and busbw > 0 enforced by
    trying the two one-parameter fits whenever the free fit leaves the feasible set. With
    ``busbw_GBps`` given, only the latency is fitted. A regime whose time does not grow with size
    returns busbw = inf (no bandwidth term); ``fit_comm`` replaces it.
    """
    t = np.asarray(times_us, dtype=float)
    x = np.asarray(sizes, dtype=float) * factor  # bytes on the "bus"
    if len(t) == 0 or np.any(t <= 0):
        raise SpecError("time_us", list(times_us), "needs at least one positive time")
    if busbw_GBps is not None:  # minimise sum(((lat + beta x) / t - 1)^2) over lat >= 0 only
        beta = 1e-3 / busbw_GBps
        lat = float(np.sum((1 - beta * x / t) / t) / np.sum(1 / t**2))
        return max(lat, 0.0), busbw_GBps
    a = np.column_stack([1.0 / t, x / t])
    candidates = []
    if len(t) >= 2:
        (lat, beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
        if lat >= 0 and beta > 0:
            candidates.append((float(lat), float(beta)))
    # latency only: weighted mean; bandwidth only: line through the origin
    candidates.append((float(np.sum(1 / t) / np.sum(1 / t**2)), 0.0))
    if np.any(x > 0):
        candidates.append((0.0, float(np.sum(x / t) / np.sum((x / t) ** 2))))
    lat, beta = min(candidates, key=lambda c: float(np.sum(((c[0] + c[1] * x) / t - 1) ** 2)))
    # beta is us per byte: busbw [GB/s] = 1e-3 / beta
    return lat, (1e-3 / beta if beta > 0 else math.inf)


def _rel_errors(fit: CommFit, factor: float, sizes: np.ndarray, t: np.ndarray) -> np.ndarray:
    pred = np.array(
        [fit.regime(s).latency_us + s * factor * 1e-3 / fit.regime(s).busbw_GBps for s in sizes]
    )
    return np.abs(pred - t) / t


def fit_comm(points: Sequence[CommPoint], num_regimes: int = 3, min_points: int = 3) -> FitReport:
    """Piecewise fit of one (collective, tier, n) series; breakpoints chosen by brute force."""
    if not points:
        raise SpecError("measurements", [], "no points to fit")
    p0 = points[0]
    if num_regimes < 1 or num_regimes > 4:
        raise SpecError("--regimes", num_regimes, "allowed: 1 to 4")
    by_size: dict[float, list[float]] = defaultdict(list)
    for p in points:
        by_size[p.size_bytes].append(p.time_us)
    sizes = np.array(sorted(by_size))
    # repeated runs of one size: the median is robust to one noisy run
    t = np.array([float(np.median(by_size[s])) for s in sizes])
    if np.any(t <= 0):
        raise SpecError("time_us", float(t.min()), f"{p0.collective}: times must be > 0")
    factor = busbw_factor(p0.collective, p0.num_ranks)
    n = len(sizes)
    k = max(1, min(num_regimes, n // min_points))
    best_bw = float(np.max(sizes * factor / t)) * 1e-3  # GB/s; t in us
    capped: dict[tuple[int, ...], list[tuple[int, float]]] = {}

    def build(bounds: Sequence[int]) -> CommFit:
        edges = [0, *bounds, n]
        regimes = []
        for i in range(len(edges) - 1):
            lo, hi = edges[i], edges[i + 1]
            lat, bw = fit_regime(sizes[lo:hi], t[lo:hi], factor)
            if bw > MAX_BUSBW_OVER_MEASURED * best_bw:
                capped.setdefault(tuple(bounds), []).append((i, bw))
                lat, bw = fit_regime(sizes[lo:hi], t[lo:hi], factor, best_bw)
            # the boundary between two measured sizes sits at their geometric mean
            max_b = float(round(math.sqrt(sizes[hi - 1] * sizes[hi]))) if hi < n else math.inf
            # rounded for a readable file; the reported error is computed after rounding
            regimes.append(
                CommRegime(
                    latency_us=float(f"{lat:.6g}"), busbw_GBps=float(f"{bw:.6g}"), max_bytes=max_b
                )
            )
        return CommFit(
            p0.collective,
            p0.tier,
            tuple(regimes),
            p0.num_ranks,
            ranks_per_domain=p0.ranks_per_domain,
        )

    single = build([])
    single_err = float(_rel_errors(single, factor, sizes, t).max())
    best, best_key, best_bounds = single, (single_err, math.inf), ()
    for bounds in itertools.combinations(range(min_points, n - min_points + 1), k - 1):
        edges = [0, *bounds, n]
        if any(edges[i + 1] - edges[i] < min_points for i in range(len(edges) - 1)):
            continue
        cand = build(bounds)
        err = _rel_errors(cand, factor, sizes, t)
        key = (float(err.max()), float(np.sum(err**2)))
        if key < best_key or best is single:
            best, best_key, best_bounds = cand, key, tuple(bounds)
    err = float(_rel_errors(best, factor, sizes, t).max())
    fit = CommFit(
        best.collective,
        best.tier,
        best.regimes,
        best.num_ranks,
        round(err, 4),
        num_points=n,
        single_regime_max_rel_error=round(single_err, 4),
        ranks_per_domain=best.ranks_per_domain,
    )
    return FitReport(
        p0.collective,
        p0.tier,
        p0.num_ranks,
        n,
        err,
        single_err,
        fit,
        best_bw,
        tuple(capped.get(best_bounds, [])),
    )


def points_from_nccl_tests(
    tests: Iterable[NcclTest], tier: str | None = None, column: str = "out-of-place"
) -> list[CommPoint]:
    """Measured points from parsed logs; the tier is inferred from the hosts unless given."""
    points = []
    for test in tests:
        t_tier = tier or ("scale_up" if len(test.hosts) <= 1 else "scale_out")
        per_domain = test.num_ranks // max(1, len(test.hosts))
        for row in test.rows:
            times = [row.out_of_place[0]]
            if row.in_place is not None:
                times.append(row.in_place[0])
            time_us = {"out-of-place": times[0], "in-place": times[-1], "min": min(times)}[column]
            if row.size_bytes > 0 and time_us > 0:
                points.append(
                    CommPoint(
                        str(test.collective),
                        t_tier,
                        test.num_ranks,
                        float(row.size_bytes),
                        time_us,
                        per_domain,
                    )
                )
    return points


def points_from_bench_json(
    doc: dict[str, Any], where: str, tier: str | None = None, column: str = "out-of-place"
) -> list[CommPoint]:
    """Points from the ``--json`` document of ``aihpc bench comm``."""
    points = []
    for i, r in enumerate(doc.get("results", [])):
        try:
            times = [float(r["time_us"])]
            if isinstance(r.get("in_place"), dict):
                times.append(float(r["in_place"]["time_us"]))
            time_us = {"out-of-place": times[0], "in-place": times[-1], "min": min(times)}[column]
            if not all(map(math.isfinite, times)) or not math.isfinite(float(r["size_bytes"])):
                raise ValueError("a time or size that is not a finite number")
            if not isinstance(r["collective"], str) or not isinstance(tier or r["tier"], str):
                raise TypeError("collective and tier are names")
            if float(r["size_bytes"]) <= 0 or time_us <= 0:
                continue  # an empty chunk (size below n x 16 B) says nothing about the link
            points.append(
                CommPoint(
                    r["collective"],
                    tier or r["tier"],
                    int(r["num_ranks"]),
                    float(r["size_bytes"]),
                    time_us,
                    int(r.get("ranks_per_domain", 0)),
                )
            )
        except (KeyError, TypeError, ValueError, OverflowError) as err:
            raise SpecError(f"{where}: results[{i}]", r, f"missing or bad field ({err})") from err
    return points


def gemm_points_from_json(doc: dict[str, Any], where: str) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for i, r in enumerate(doc.get("results", [])):
        try:
            point = (float(r["gflop"]), float(r["tflops"]))
            if not all(map(math.isfinite, point)):
                raise ValueError("gflop and tflops must be finite numbers")
            out[str(r["precision"])].append(point)
        except (KeyError, TypeError, ValueError) as err:
            raise SpecError(f"{where}: results[{i}]", r, f"missing or bad field ({err})") from err
    return out


def load_measurements(
    paths: Sequence[str | Path],
    tier: str | None = None,
    collective: str | None = None,
    column: str = "out-of-place",
) -> tuple[list[CommPoint], dict[str, list[tuple[float, float]]]]:
    """Read every input: ``aihpc bench comm|moe|gemm --json`` documents or nccl-tests text
    logs (a moe document contributes its ``calibration`` points: all_to_all)."""
    if tier is not None and tier not in TIERS:
        raise SpecError("--tier", tier, "allowed: " + " | ".join(TIERS))
    if column not in ("out-of-place", "in-place", "min"):
        raise SpecError("--column", column, "allowed: out-of-place | in-place | min")
    comm: list[CommPoint] = []
    gemm: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for path in map(Path, paths):
        text = read_input(path, "INPUT", "a benchmark JSON or nccl-tests log", errors="replace")
        if text.lstrip()[:1] == "{":
            doc = parse_json(text, "INPUT", str(path))
            if not isinstance(doc, dict) or not isinstance(doc.get("results", []), list):
                raise SpecError("INPUT", str(path), "expected a JSON object with a results list")
            kind = doc.get("benchmark")
            if kind == "comm":
                comm += points_from_bench_json(doc, path.name, tier, column)
            elif kind == "moe":  # our dispatch / combine as all_to_all points (bench/moe.py)
                calib = {"results": doc.get("calibration") or []}
                if not isinstance(calib["results"], list):
                    raise SpecError(f"INPUT {path}: calibration", calib["results"], "a list")
                comm += points_from_bench_json(calib, path.name, tier, "out-of-place")
            elif kind == "gemm":
                for prec, pts in gemm_points_from_json(doc, path.name).items():
                    gemm[prec] += pts
            elif "results" in doc and ("config" in doc or "nccl_version" in doc):
                comm += points_from_nccl_tests(read_nccl_tests_log(path, collective), tier, column)
            else:
                raise SpecError(
                    "INPUT",
                    str(path),
                    "JSON must come from `aihpc bench comm|moe|gemm --json` (key "
                    "benchmark = comm | moe | gemm) or nccl-tests -J",
                )
        else:
            comm += points_from_nccl_tests(read_nccl_tests_log(path, collective), tier, column)
    if not comm and not gemm:
        raise SpecError("INPUT", [str(p) for p in paths], "no measurements found")
    return comm, dict(gemm)


def fit_to_calibration(
    comm: Sequence[CommPoint],
    gemm: dict[str, list[tuple[float, float]]],
    source: str,
    num_regimes: int = 3,
) -> tuple[Calibration, list[FitReport]]:
    """Fit every (collective, tier) series; when one is measured at several group sizes, the
    largest group wins (it is the one a training job of that tier runs on)."""
    series: dict[tuple[str, str], dict[int, list[CommPoint]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for p in comm:
        series[(p.collective, p.tier)][p.num_ranks].append(p)
    reports = []
    for key in sorted(series):
        n = max(series[key])
        reports.append(fit_comm(series[key][n], num_regimes))
    gemm_fits = {}
    for prec, pts in sorted(gemm.items()):
        by_gflop: dict[float, list[float]] = defaultdict(list)
        for g, tf in pts:
            if g > 0 and tf > 0:
                by_gflop[float(f"{g:.6g}")].append(tf)
        if by_gflop:
            gemm_fits[prec] = GemmFit(
                prec, tuple((g, float(f"{np.mean(v):.4g}")) for g, v in sorted(by_gflop.items()))
            )
    cal = Calibration(
        comm={(r.collective, r.tier): r.fit for r in reports}, gemm=gemm_fits, source=source
    )
    return cal, reports
