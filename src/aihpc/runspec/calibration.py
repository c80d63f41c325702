"""Calibration: measured collective and GEMM figures that override the model's defaults.

Written by ``aihpc calibrate`` and named in a run spec by ``[cluster] calibration = "FILE"``.
File layout (TOML)::

    source = "what it was fitted from"
    overlap_compute_penalty = 0.8  # optional: this host's slow-down of compute beside a hidden
                                   # collective, a fraction of its time (calibrate --local)
    dtensor_op_us = 45.0           # optional: this host's time to dispatch one op on a DTensor
                                   # beyond the plain op, microseconds (calibrate --local)
    dtensor_optimizer_op_us = 22.0 # optional: the same for one op of the optimizer step (AdamW
                                   # and the clipping over DTensor parameters; calibrate --local)
    [[comm]]                       # one per (collective, tier)
    collective = "all_reduce"      # all_reduce | all_gather | reduce_scatter | all_to_all |
                                   # broadcast | send_recv
    tier = "scale_up"              # scale_up (inside the NVLink domain) | scale_out (across it)
    num_ranks = 8                  # ranks in the measured group
    ranks_per_domain = 8           # optional: of them, ranks per node / NVLink domain (0: unknown)
    max_rel_error = 0.04           # fit quality over the measured sizes
    num_points = 24                # optional: measured sizes behind the fit
    single_regime_max_rel_error = 0.25   # optional: what a one-line fit would have missed by
    regimes = [                    # ascending; the last one has no max_bytes
      { max_bytes = 1048576, latency_us = 9.5, busbw_GBps = 110.0 },
      { latency_us = 31.0, busbw_GBps = 365.0 },
    ]
    [[gemm]]
    precision = "bf16"
    points = [[0.5, 310.0], [8.0, 640.0], [137.4, 720.0]]   # [GFLOP per GEMM, achieved TFLOP/s]
    [efficiency]                   # fitted to measured training runs (aihpc calibrate --runs)
    gemm = 0.95                    # multiplies the GEMM efficiency the model would use
    attention = 1.1                # multiplies the fused attention kernel's efficiency
    scale_up = 1.0                 # multiplies the NVLink bus bandwidth (where no [[comm]] fit)
    scale_out = 0.9                # multiplies the network bus bandwidth (where no [[comm]] fit)
    num_runs = 12                  # optional: runs behind the fit, and its mean absolute errors
    fitted_mape = 0.04             # on them and leave-one-out cross-validated
    loo_mape = 0.06

Time of a collective of whole-buffer size S (nccl-tests convention) on n ranks is
``latency + S * busbw_factor(n) / busbw`` in the regime S falls in.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aihpc.runspec.errors import SpecError
from aihpc.runspec.inputs import parse_toml, read_input

__all__ = [
    "COLLECTIVES",
    "EFFICIENCY_SCALES",
    "TIERS",
    "Calibration",
    "CommFit",
    "CommRegime",
    "EfficiencyScales",
    "GemmFit",
    "busbw_factor",
    "calibration_from_dict",
    "calibration_to_toml",
    "load_calibration",
]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
TIERS = ("scale_up", "scale_out")


def busbw_factor(collective: str, num_ranks: int) -> float:
    """nccl-tests' algbw -> busbw factor (doc/PERFORMANCE.md; ``*GetBw`` in src/*.cu): all-reduce
    2(n-1)/n; all-gather, reduce-scatter, all-to-all (n-1)/n; broadcast and send/recv 1. The one
    definition the benchmarks (aihpc.bench) and the model (aihpc.perf) share."""
    n = num_ranks
    if n < 1:
        raise SpecError("num_ranks", n, "must be >= 1")
    if collective == "all_reduce":
        return 2.0 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if collective in ("broadcast", "send_recv"):
        return 1.0
    raise SpecError("collective", collective, "allowed: " + " | ".join(COLLECTIVES))


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
    num_points: int = 0
    single_regime_max_rel_error: float | None = None
    # Ranks of the measured group per node: a scale-out figure measured with 8 GPUs per node
    # moved 1/8 of the bytes through each NIC (0 = unknown).
    ranks_per_domain: int = 0

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


# The efficiencies a calibration fitted to measured runs may scale: GEMMs, fused attention, and
# the bus bandwidth of the scale-up (NVLink) and scale-out (network) tiers.
EFFICIENCY_SCALES = ("gemm", "attention", "scale_up", "scale_out")


@dataclass(frozen=True)
class EfficiencyScales:
    """Multipliers on the model's efficiencies, fitted to a user's measured training runs
    (``aihpc calibrate --runs``); 1.0 leaves an efficiency as the catalog and constants say."""

    gemm: float = 1.0
    attention: float = 1.0
    scale_up: float = 1.0
    scale_out: float = 1.0
    num_runs: int = 0
    fitted_mape: float | None = None
    loo_mape: float | None = None

    def scales(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in EFFICIENCY_SCALES}


@dataclass(frozen=True)
class Calibration:
    comm: dict[tuple[str, str], CommFit] = field(default_factory=dict)
    gemm: dict[str, GemmFit] = field(default_factory=dict)
    source: str = ""
    path: str = ""
    efficiency: EfficiencyScales | None = None
    # Slow-down of compute beside a collective it hides, as a fraction of the collective's
    # time, measured on this host (`aihpc calibrate --local`); None: the model's constant
    # (params.overlap_compute_penalty, a GPU measurement).
    overlap_compute_penalty: float | None = None
    # Host time DTensor's dispatch adds to one op of this trainer's tensor-parallel layer,
    # microseconds, measured on this host (`aihpc calibrate --local`); None: the model's
    # constant (params.dtensor_op_s).
    dtensor_op_us: float | None = None
    # The same for one op of the optimizer step (AdamW's per-parameter loop and the gradient
    # clipping over DTensor parameters), which costs DTensor less than a layer's op; None:
    # dtensor_op_us, else the model's constant.
    dtensor_optimizer_op_us: float | None = None

    def comm_fit(self, collective: str, tier: str) -> CommFit | None:
        return self.comm.get((collective, tier))

    def scale(self, name: str) -> float:
        """The fitted multiplier on efficiency ``name`` (one of EFFICIENCY_SCALES), else 1."""
        return getattr(self.efficiency, name) if self.efficiency is not None else 1.0


def _num(where: str, value: Any, allow_inf: bool = False) -> float:
    """A non-negative number; nan never, inf only where it means "no upper bound"."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or math.isnan(value)
        or value < 0
        or (math.isinf(value) and not allow_inf)
    ):
        kind = "a non-negative number or inf" if allow_inf else "a finite non-negative number"
        raise SpecError(where, value, f"expected {kind}")
    return float(value)


_TOP_KEYS = (
    "source",
    "comm",
    "gemm",
    "efficiency",
    "overlap_compute_penalty",
    "dtensor_op_us",
    "dtensor_optimizer_op_us",
)
_COMM_KEYS = (
    "collective",
    "tier",
    "num_ranks",
    "max_rel_error",
    "regimes",
    "num_points",
    "single_regime_max_rel_error",
    "ranks_per_domain",
)
_REGIME_KEYS = ("max_bytes", "latency_us", "busbw_GBps")
_GEMM_KEYS = ("precision", "points")
_EFFICIENCY_KEYS = (*EFFICIENCY_SCALES, "num_runs", "fitted_mape", "loo_mape")


def _known(where: str, table: Any, allowed: tuple[str, ...]) -> None:
    # unknown keys are errors: a misspelt busbw must not silently fall back to the defaults
    if not isinstance(table, dict):
        raise SpecError(where, table, "expected a table")
    for key in table:
        if key not in allowed:
            raise SpecError(
                f"{where}.{key}", table[key], "unknown key; allowed: " + ", ".join(allowed)
            )


def _array(where: str, value: Any) -> list[Any]:
    """A TOML array (``[[comm]]``, ``regimes = [...]``, ``points = [...]``), else a SpecError."""
    if not isinstance(value, list):
        raise SpecError(where, value, "expected an array")
    return value


def _point(where: str, value: Any) -> tuple[float, float]:
    if not (isinstance(value, list) and len(value) == 2):
        raise SpecError(where, value, "needs [GFLOP, TFLOP/s] pairs, both > 0")
    return _num(where, value[0]), _num(where, value[1])


def _comm_fit(i: int, entry: Any) -> CommFit:
    """The ``[[comm]]`` entry number ``i``, checked."""
    where = f"calibration.comm[{i}]"
    _known(where, entry, _COMM_KEYS)
    coll, tier = entry.get("collective"), entry.get("tier")
    if coll not in COLLECTIVES:
        raise SpecError(f"{where}.collective", coll, "allowed: " + " | ".join(COLLECTIVES))
    if tier not in TIERS:
        raise SpecError(f"{where}.tier", tier, "allowed: " + " | ".join(TIERS))
    regimes = []
    for j, r in enumerate(_array(f"{where}.regimes", entry.get("regimes", []))):
        _known(f"{where}.regimes[{j}]", r, _REGIME_KEYS)
        bw = _num(f"{where}.regimes[{j}].busbw_GBps", r.get("busbw_GBps"))
        if bw <= 0:
            raise SpecError(f"{where}.regimes[{j}].busbw_GBps", bw, "must be > 0")
        regimes.append(
            CommRegime(
                latency_us=_num(f"{where}.regimes[{j}].latency_us", r.get("latency_us", 0.0)),
                busbw_GBps=bw,
                max_bytes=_num(
                    f"{where}.regimes[{j}].max_bytes", r.get("max_bytes", math.inf), True
                ),
            )
        )
    if not regimes:
        raise SpecError(f"{where}.regimes", [], "needs at least one regime")
    err = entry.get("max_rel_error")
    single = entry.get("single_regime_max_rel_error")
    return CommFit(
        coll,
        tier,
        tuple(sorted(regimes, key=lambda r: r.max_bytes)),
        int(_num(f"{where}.num_ranks", entry.get("num_ranks", 0))),
        None if err is None else _num(f"{where}.max_rel_error", err),
        int(_num(f"{where}.num_points", entry.get("num_points", 0))),
        None if single is None else _num(f"{where}.single_regime_max_rel_error", single),
        int(_num(f"{where}.ranks_per_domain", entry.get("ranks_per_domain", 0))),
    )


def calibration_from_dict(data: dict[str, Any], path: str = "") -> Calibration:
    _known("calibration", data, _TOP_KEYS)
    comm: dict[tuple[str, str], CommFit] = {}
    for i, entry in enumerate(_array("calibration.comm", data.get("comm", []))):
        fit = _comm_fit(i, entry)
        comm[(fit.collective, fit.tier)] = fit
    gemm: dict[str, GemmFit] = {}
    for i, entry in enumerate(_array("calibration.gemm", data.get("gemm", []))):
        where = f"calibration.gemm[{i}]"
        _known(where, entry, _GEMM_KEYS)
        pts = sorted(
            _point(f"{where}.points", p) for p in _array(f"{where}.points", entry.get("points", []))
        )
        if not pts or any(p[0] <= 0 or p[1] <= 0 for p in pts):
            raise SpecError(
                f"{where}.points", entry.get("points"), "needs [GFLOP, TFLOP/s] pairs, both > 0"
            )
        gemm[str(entry.get("precision", "bf16"))] = GemmFit(
            str(entry.get("precision", "bf16")), tuple(pts)
        )
    return Calibration(
        comm=comm,
        gemm=gemm,
        source=str(data.get("source", "")),
        path=path,
        efficiency=_efficiency(data["efficiency"]) if "efficiency" in data else None,
        overlap_compute_penalty=_penalty(data.get("overlap_compute_penalty")),
        dtensor_op_us=_optional_num("calibration.dtensor_op_us", data.get("dtensor_op_us")),
        dtensor_optimizer_op_us=_optional_num(
            "calibration.dtensor_optimizer_op_us", data.get("dtensor_optimizer_op_us")
        ),
    )


def _optional_num(where: str, value: Any) -> float | None:
    return None if value is None else _num(where, value)


def _penalty(value: Any) -> float | None:
    """A measured overlap penalty: a fraction of the hidden time in [0, 1], or absent."""
    if value is None:
        return None
    value = _num("calibration.overlap_compute_penalty", value)
    if value > 1:
        raise SpecError("calibration.overlap_compute_penalty", value, "a fraction in [0, 1]")
    return value


def _efficiency(table: Any) -> EfficiencyScales:
    _known("calibration.efficiency", table, _EFFICIENCY_KEYS)
    values: dict[str, Any] = {}
    for name in EFFICIENCY_SCALES:
        value = _num(f"calibration.efficiency.{name}", table.get(name, 1.0))
        if value <= 0:
            raise SpecError(f"calibration.efficiency.{name}", value, "a multiplier must be > 0")
        values[name] = value
    if "num_runs" in table:
        values["num_runs"] = int(_num("calibration.efficiency.num_runs", table["num_runs"]))
    for name in ("fitted_mape", "loo_mape"):
        if name in table:
            values[name] = _num(f"calibration.efficiency.{name}", table[name])
    return EfficiencyScales(**values)


def load_calibration(path: str | Path) -> Calibration:
    path = Path(path)
    text = read_input(path, "cluster.calibration", "a calibration .toml file")
    data = parse_toml(text, "cluster.calibration", str(path))
    return calibration_from_dict(data, str(path))


def _fmt(value: float) -> str:
    # shortest round-trip text; TOML spells infinity "inf"
    return "inf" if value == math.inf else repr(float(value))


def calibration_to_toml(cal: Calibration, header: str = "") -> str:
    """The TOML text ``load_calibration`` reads back to an equal Calibration."""
    lines = [f"# {h}" for h in header.splitlines()]
    lines.append(f"source = {_quote(cal.source)}")
    if cal.overlap_compute_penalty is not None:
        lines.append(f"overlap_compute_penalty = {_fmt(cal.overlap_compute_penalty)}")
    if cal.dtensor_op_us is not None:
        lines.append(f"dtensor_op_us = {_fmt(cal.dtensor_op_us)}")
    if cal.dtensor_optimizer_op_us is not None:
        lines.append(f"dtensor_optimizer_op_us = {_fmt(cal.dtensor_optimizer_op_us)}")
    for (coll, tier), fit in sorted(cal.comm.items()):
        lines += [
            "",
            "[[comm]]",
            f'collective = "{coll}"',
            f'tier = "{tier}"',
            f"num_ranks = {fit.num_ranks}",
        ]
        if fit.ranks_per_domain:
            lines.append(f"ranks_per_domain = {fit.ranks_per_domain}")
        if fit.num_points:
            lines.append(f"num_points = {fit.num_points}")
        if fit.max_rel_error is not None:
            lines.append(f"max_rel_error = {_fmt(fit.max_rel_error)}")
        if fit.single_regime_max_rel_error is not None:
            lines.append(f"single_regime_max_rel_error = {_fmt(fit.single_regime_max_rel_error)}")
        lines.append("regimes = [")
        for r in fit.regimes:
            bound = "" if r.max_bytes == math.inf else f"max_bytes = {_fmt(r.max_bytes)}, "
            lines.append(
                f"  {{ {bound}latency_us = {_fmt(r.latency_us)}, "
                f"busbw_GBps = {_fmt(r.busbw_GBps)} }},"
            )
        lines.append("]")
    for prec, g in sorted(cal.gemm.items()):
        pts = ", ".join(f"[{_fmt(a)}, {_fmt(b)}]" for a, b in g.points)
        lines += ["", "[[gemm]]", f"precision = {_quote(prec)}", f"points = [{pts}]"]
    if cal.efficiency is not None:
        eff = cal.efficiency
        lines += ["", "[efficiency]"]
        lines += [f"{name} = {_fmt(value)}" for name, value in eff.scales().items()]
        if eff.num_runs:
            lines.append(f"num_runs = {eff.num_runs}")
        for name in ("fitted_mape", "loo_mape"):
            if getattr(eff, name) is not None:
                lines.append(f"{name} = {_fmt(getattr(eff, name))}")
    return "\n".join(lines) + "\n"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ") + '"'
