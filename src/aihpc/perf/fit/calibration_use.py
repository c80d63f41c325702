"""What a calibration file did to one estimate: which of its fits the plan's pricing looked up,
which step-time terms they changed, and which of its figures are not physical.

A calibration that silently covers nothing the plan uses (a scale-up file on a multi-node plan, a
bf16 GEMM table under fp8) looks exactly like one that was used; this module makes the
difference visible. It watches the estimate ask the calibration for fits (the estimate code is
not changed for it) and prices the plan a second time without the file to see which terms moved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from aihpc.perf.step.estimate import estimate
from aihpc.runspec.calibration import Calibration, CommFit, EfficiencyScales
from aihpc.runspec.runspec import RunSpec

__all__ = ["MAX_BUSBW_LINK_RATIO", "CalibrationUse", "calibration_use", "implausible_regimes"]

# busbw is "ring-equivalent" bandwidth: an in-network reduction (NVLS inside an NVLink domain,
# SHARP across it) sends each byte once instead of 2(n-1)/n times, so a measured all-reduce
# busbw can reach 2(n-1)/n < 2 times the wire speed (nccl-tests doc/PERFORMANCE.md; issues #153,
# #274), and no algorithm more. A fitted regime above twice the GPU's fastest link is not a
# measurement: a size whose time did not grow with the bytes (a latency-only fit) or noise.
MAX_BUSBW_LINK_RATIO = 2.0


class _AskedDict(dict):  # type: ignore[type-arg]
    """A dict that records the keys it was asked about (the GEMM table's precisions)."""

    def __init__(self, data: dict[Any, Any], asked: set[Any]) -> None:
        super().__init__(data)
        self.asked = asked

    def __contains__(self, key: object) -> bool:
        self.asked.add(key)
        return super().__contains__(key)


@dataclass(frozen=True)
class _Recording(Calibration):
    """The same calibration, recording each (collective, tier) the pricing asks for."""

    asked: set[tuple[str, str]] = field(default_factory=set)

    def comm_fit(self, collective: str, tier: str) -> CommFit | None:
        self.asked.add((collective, tier))
        return super().comm_fit(collective, tier)


@dataclass(frozen=True)
class CalibrationUse:
    path: str
    source: str
    covers: tuple[tuple[str, str], ...]  # (collective, tier) fits in the file
    gemm_covers: tuple[str, ...]  # precisions of its GEMM table
    asked: tuple[tuple[str, str], ...]  # (collective, tier) this plan's pricing looked up
    used: tuple[tuple[str, str], ...]  # asked and in the file
    gemm_used: tuple[str, ...]  # precisions looked up and in the file
    terms: tuple[str, ...]  # step-time terms (Estimate.time_s keys) the file changed
    implausible: tuple[str, ...]  # regimes whose busbw no link can carry, as sentences
    efficiency: EfficiencyScales | None = None  # scales fitted to measured runs

    @property
    def missing(self) -> tuple[tuple[str, str], ...]:
        """Collectives the plan uses that the file has no fit for (priced from the catalog)."""
        return tuple(p for p in self.asked if p not in self.covers)

    @property
    def warnings(self) -> list[str]:
        out = []
        name = self.path or "the calibration"
        if self.covers and not self.used and self.asked:
            out.append(
                f"{name} covers none of the collectives this plan uses "
                f"({_pairs(self.asked)}): its communication is priced from the GPU catalog"
            )
        if self.gemm_covers and not self.gemm_used:
            out.append(
                f"{name} has GEMM points for {', '.join(self.gemm_covers)} only, not for the "
                "precision this plan computes in: its compute is priced from the GPU catalog"
            )
        out += [f"{name}: {text}" for text in self.implausible]
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "source": self.source,
            "covers": [{"collective": c, "tier": t} for c, t in self.covers],
            "gemm_covers": list(self.gemm_covers),
            "used": [{"collective": c, "tier": t} for c, t in self.used],
            "not_covered": [{"collective": c, "tier": t} for c, t in self.missing],
            "gemm_used": list(self.gemm_used),
            "terms": list(self.terms),
            "efficiency": _efficiency_json(self.efficiency),
            "warnings": self.warnings,
        }


def _efficiency_json(eff: EfficiencyScales | None) -> dict[str, Any] | None:
    if eff is None:
        return None
    return {
        "scales": eff.scales(),
        "num_runs": eff.num_runs,
        "fitted_mape": eff.fitted_mape,
        "loo_mape": eff.loo_mape,
    }


def _pairs(pairs: tuple[tuple[str, str], ...]) -> str:
    return ", ".join(f"{c}/{t}" for c, t in pairs)


def _span(fit: CommFit, i: int) -> str:
    r = fit.regimes[i]
    if r.max_bytes != math.inf:
        return f"sizes <= {r.max_bytes:,.0f} B"
    return "the largest sizes" if len(fit.regimes) > 1 else "every size"


def implausible_regimes(cal: Calibration, link_GBps: float) -> list[str]:
    """Sentences naming each regime whose busbw exceeds MAX_BUSBW_LINK_RATIO x ``link_GBps``."""
    limit = MAX_BUSBW_LINK_RATIO * link_GBps
    out = []
    for (coll, tier), fit in sorted(cal.comm.items()):
        for i, r in enumerate(fit.regimes):
            if r.busbw_GBps > limit:
                out.append(
                    f"{coll}/{tier} busbw_GBps = {r.busbw_GBps:g} for {_span(fit, i)} is above "
                    f"what any algorithm moves on this GPU ({MAX_BUSBW_LINK_RATIO:g} x its "
                    f"{link_GBps:g} GB/s links): not a measurement; re-measure those sizes"
                )
    return out


def calibration_use(spec: RunSpec) -> CalibrationUse | None:
    """How the run spec's calibration entered the estimate of its plan (None: no calibration)."""
    cal = spec.cluster.calibration
    if cal is None:
        return None
    asked_gemm: set[str] = set()
    rec = _Recording(
        comm=dict(cal.comm),
        gemm=_AskedDict(cal.gemm, asked_gemm),
        source=cal.source,
        path=cal.path,
        efficiency=cal.efficiency,
    )
    with_cal = estimate(replace(spec, cluster=replace(spec.cluster, calibration=rec)))
    without = estimate(replace(spec, cluster=replace(spec.cluster, calibration=None)))
    terms = tuple(
        k
        for k, v in with_cal.time_s.items()
        if not math.isclose(v, without.time_s.get(k, 0.0), rel_tol=1e-12, abs_tol=1e-15)
    )
    asked = tuple(sorted(rec.asked))
    link = max(spec.cluster.scale_up_bw_GBps, spec.cluster.scale_out_bw_GBps)
    return CalibrationUse(
        path=cal.path,
        source=cal.source,
        covers=tuple(sorted(cal.comm)),
        gemm_covers=tuple(sorted(cal.gemm)),
        asked=asked,
        used=tuple(p for p in asked if p in cal.comm),
        gemm_used=tuple(sorted(p for p in asked_gemm if p in cal.gemm)),
        terms=terms,
        implausible=tuple(implausible_regimes(cal, link)),
        efficiency=cal.efficiency,
    )
