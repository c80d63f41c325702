"""Calibration: measured collective and GEMM figures that override the model's defaults.

Written by ``aihpc calibrate`` and named in a run spec by ``[cluster] calibration = "FILE"``.
File layout (TOML)::

    source = "what it was fitted from"
    [[comm]]                       # one per (collective, tier)
    collective = "all_reduce"      # all_reduce | all_gather | reduce_scatter | all_to_all |
                                   # broadcast | send_recv
    tier = "scale_up"              # scale_up (inside the NVLink domain) | scale_out (across it)
    num_ranks = 8                  # ranks in the measured group
    max_rel_error = 0.04           # fit quality over the measured sizes
    regimes = [                    # ascending; the last one has no max_bytes
      { max_bytes = 1048576, latency_us = 9.5, busbw_GBps = 110.0 },
      { latency_us = 31.0, busbw_GBps = 365.0 },
    ]
    [[gemm]]
    precision = "bf16"
    points = [[0.5, 310.0], [8.0, 640.0], [137.4, 720.0]]   # [GFLOP per GEMM, achieved TFLOP/s]

Time of a collective of whole-buffer size S (nccl-tests convention) on n ranks is
``latency + S * busbw_factor(n) / busbw`` in the regime S falls in.
"""

from __future__ import annotations

import bisect
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aihpc.spec.errors import SpecError

__all__ = ["COLLECTIVES", "TIERS", "Calibration", "CommFit", "CommRegime", "GemmFit",
           "load_calibration"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
TIERS = ("scale_up", "scale_out")


@dataclass(frozen=True)
class CommRegime:
    latency_us: float
    busbw_GBps: float
    max_bytes: float = math.inf


@dataclass(frozen=True)
class CommFit:
    collective: str
    tier: str
    regimes: tuple[CommRegime, ...]
    num_ranks: int = 0
    max_rel_error: float | None = None

    def regime(self, size_bytes: float) -> CommRegime:
        for r in self.regimes:
            if size_bytes <= r.max_bytes:
                return r
        return self.regimes[-1]


@dataclass(frozen=True)
class GemmFit:
    precision: str
    points: tuple[tuple[float, float], ...]  # (GFLOP, achieved TFLOP/s), ascending GFLOP

    def achieved_tflops(self, gflop: float) -> float:
        """Piecewise-linear in log(GFLOP), clamped at both ends."""
        xs = [math.log(p[0]) for p in self.points]
        ys = [p[1] for p in self.points]
        x = math.log(max(gflop, 1e-12))
        if x <= xs[0]:
            return ys[0]
        if x >= xs[-1]:
            return ys[-1]
        i = bisect.bisect_right(xs, x)
        w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + w * (ys[i] - ys[i - 1])


@dataclass(frozen=True)
class Calibration:
    comm: dict[tuple[str, str], CommFit] = field(default_factory=dict)
    gemm: dict[str, GemmFit] = field(default_factory=dict)
    source: str = ""
    path: str = ""

    def comm_fit(self, collective: str, tier: str) -> CommFit | None:
        return self.comm.get((collective, tier))


def _num(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise SpecError(where, value, "expected a non-negative number")
    return float(value)


def calibration_from_dict(data: dict[str, Any], path: str = "") -> Calibration:
    comm: dict[tuple[str, str], CommFit] = {}
    for i, entry in enumerate(data.get("comm", [])):
        where = f"calibration.comm[{i}]"
        coll, tier = entry.get("collective"), entry.get("tier")
        if coll not in COLLECTIVES:
            raise SpecError(f"{where}.collective", coll, "allowed: " + " | ".join(COLLECTIVES))
        if tier not in TIERS:
            raise SpecError(f"{where}.tier", tier, "allowed: " + " | ".join(TIERS))
        regimes = []
        for j, r in enumerate(entry.get("regimes", [])):
            bw = _num(f"{where}.regimes[{j}].busbw_GBps", r.get("busbw_GBps"))
            if bw <= 0:
                raise SpecError(f"{where}.regimes[{j}].busbw_GBps", bw, "must be > 0")
            regimes.append(CommRegime(
                latency_us=_num(f"{where}.regimes[{j}].latency_us", r.get("latency_us", 0.0)),
                busbw_GBps=bw,
                max_bytes=_num(f"{where}.regimes[{j}].max_bytes", r.get("max_bytes", math.inf)),
            ))
        if not regimes:
            raise SpecError(f"{where}.regimes", [], "needs at least one regime")
        comm[(coll, tier)] = CommFit(coll, tier, tuple(sorted(regimes, key=lambda r: r.max_bytes)),
                                     int(entry.get("num_ranks", 0)), entry.get("max_rel_error"))
    gemm: dict[str, GemmFit] = {}
    for i, entry in enumerate(data.get("gemm", [])):
        where = f"calibration.gemm[{i}]"
        pts = sorted((_num(f"{where}.points", p[0]), _num(f"{where}.points", p[1]))
                     for p in entry.get("points", []))
        if not pts or any(p[0] <= 0 or p[1] <= 0 for p in pts):
            raise SpecError(f"{where}.points", entry.get("points"),
                            "needs [GFLOP, TFLOP/s] pairs, both > 0")
        gemm[str(entry.get("precision", "bf16"))] = GemmFit(str(entry.get("precision", "bf16")),
                                                            tuple(pts))
    return Calibration(comm=comm, gemm=gemm, source=str(data.get("source", "")), path=path)


def load_calibration(path: str | Path) -> Calibration:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError as err:
        raise SpecError("cluster.calibration", str(path), "file not found") from err
    except tomllib.TOMLDecodeError as err:
        raise SpecError("cluster.calibration", str(path), f"not valid TOML ({err})") from err
    return calibration_from_dict(data, str(path))
