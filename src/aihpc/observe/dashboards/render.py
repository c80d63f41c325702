"""Draw the dashboard's panels from a Prometheus server's answers with matplotlib: the
dashboard's queries, evaluated as Grafana would, drawn without Grafana (a stand-in for a
screenshot where Grafana is not installed, and a picture for reports).

Drawn as Grafana draws them: a gap in the samples (a target down, a restart) is a gap in the
line, not a straight line across it; stacked panels stack on shared timestamps. One liberty:
a panel whose values span more than three decades (a CPU run against an H100 plan) gets a
logarithmic axis, where Grafana would need it set by hand.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aihpc._io import atomic_target
from aihpc.observe.dashboards import PanelData

__all__ = ["render"]

_SCALE = {
    "percentunit": (100.0, "%"),
    "bytes": (1 / 2**30, "GiB"),
    "Bps": (1 / 2**20, "MiB/s"),
    "s": (1.0, "s"),
}


def _with_gaps(times: list[float], values: list[float], step: float) -> tuple[list, list]:
    """Insert NaN where consecutive samples are more than 1.5 steps apart."""
    xs: list[float] = []
    ys: list[float] = []
    for i, (t, v) in enumerate(zip(times, values, strict=True)):
        if i and t - times[i - 1] > 1.5 * step:
            xs.append(t)
            ys.append(math.nan)
        xs.append(t)
        ys.append(v)
    return xs, ys


def _step(panels: Sequence[PanelData]) -> float:
    gaps = sorted(b - a for p in panels for _, t, _ in p.series for a, b in itertools.pairwise(t))
    return gaps[len(gaps) // 2] if gaps else 1.0


def _draw(ax: Any, panel: PanelData, t0: float, step: float) -> None:
    scale, unit = _SCALE.get(panel.unit, (1.0, ""))
    if panel.stacked and panel.series:
        grid = sorted({t for _, ts, _ in panel.series for t in ts})
        ys = []
        for _, ts, vs in panel.series:
            at = dict(zip(ts, vs, strict=True))
            ys.append(
                [scale * at.get(t, 0.0) if math.isfinite(at.get(t, 0.0)) else 0.0 for t in grid]
            )
        ax.stackplot([t - t0 for t in grid], ys, labels=[s[0] for s in panel.series], alpha=0.7)
    else:
        for label, times, values in panel.series:
            xs, vs = _with_gaps(times, values, step)
            ax.plot([x - t0 for x in xs], [v * scale for v in vs], label=label, lw=1.4)
        finite = [abs(v) for _, _, vs in panel.series for v in vs if math.isfinite(v) and v]
        if finite and max(finite) / min(finite) > 1e3:
            ax.set_yscale("log")
    ax.set_title(panel.title, fontsize=9, loc="left")
    ax.set_ylabel(unit, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    if any(label for label, _, _ in panel.series):
        ax.legend(fontsize=6, loc="best")
    elif not panel.series:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def render(panels: Sequence[PanelData], path: Path, title: str, cols: int = 3) -> None:
    """One subplot per panel, time in seconds from the earliest sample, units as Grafana's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min((t[0] for p in panels for _, t, _ in p.series if t), default=0.0)
    step = _step(panels)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 2.9 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        _draw(ax, panel, t0, step)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("seconds", fontsize=8)
    fig.suptitle(title, fontsize=11, x=0.01, ha="left")
    fig.tight_layout()
    with atomic_target(Path(path), "--render") as tmp:  # whole or not at all, folders made
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
