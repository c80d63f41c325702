"""Draw the dashboard's panels from a Prometheus server's answers with matplotlib: the
dashboard's queries, evaluated as Grafana would, drawn without Grafana (a stand-in for a
screenshot where Grafana is not installed, and a picture for reports)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from aihpc.observe.dashboards import PanelData

__all__ = ["render"]

_SCALE = {
    "percentunit": (100.0, "%"),
    "bytes": (1 / 2**30, "GiB"),
    "Bps": (1 / 2**20, "MiB/s"),
    "s": (1.0, "s"),
}


def render(panels: Sequence[PanelData], path: Path, title: str, cols: int = 3) -> None:
    """One subplot per panel, time in seconds from the earliest sample, units as Grafana's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min((t[0] for p in panels for _, t, _ in p.series if t), default=0.0)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 2.9 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        scale, unit = _SCALE.get(panel.unit, (1.0, ""))
        if panel.stacked and panel.series:
            times = [t - t0 for t in panel.series[0][1]]
            ys = [[v * scale if math.isfinite(v) else 0.0 for v in s[2]] for s in panel.series]
            same = all(len(y) == len(times) for y in ys)
            if same:
                ax.stackplot(times, ys, labels=[s[0] for s in panel.series], alpha=0.7)
        else:
            for label, times, values in panel.series:
                ax.plot([t - t0 for t in times], [v * scale for v in values], label=label, lw=1.4)
        ax.set_title(panel.title, fontsize=9, loc="left")
        ax.set_ylabel(unit, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if panel.series:
            ax.legend(fontsize=6, loc="best")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("seconds", fontsize=8)
    fig.suptitle(title, fontsize=11, x=0.01, ha="left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
