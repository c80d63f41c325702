"""``aihpc goodput RUN.toml --strategy compare``: recovery strategies side by side."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from aihpc.cli._common import console
from aihpc.runspec import SpecError

__all__ = ["compare_json", "parse_gpu_counts", "read_measured", "render_compare"]

LOSS_COLUMNS = {
    "checkpoint": "saves",
    "lost_work": "work redone",
    "detection": "detect",
    "restart": "restart",
    "restore": "restore",
    "planned": "planned",
}


def parse_gpu_counts(text: str | None) -> tuple[int, ...] | None:
    """'16384,100000' → (16384, 100000)."""
    if text is None:
        return None
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        counts = ()
    if not counts or any(n <= 0 for n in counts):
        raise SpecError("--gpus", text, "expected GPU counts > 0, comma-separated: 16384,100000")
    return counts


def read_measured(path: Path | None) -> dict[str, Any] | None:
    """The measured figures of a recovery_time.json (see aihpc.goodput.strategies)."""
    if path is None:
        return None
    from aihpc.goodput.strategies import measured_figures
    from aihpc.runspec.inputs import parse_json, read_input

    if not os.path.exists(path):  # False, not OSError, for a name too long
        raise SpecError("--measured", str(path), "no such file (a recovery_time.json)")
    doc = parse_json(read_input(path, "--measured", "a JSON file"), "--measured", str(path))
    if not isinstance(doc, dict):
        raise SpecError("--measured", str(path), "expected a JSON object")
    return measured_figures(doc, path.name)


def compare_json(results: dict, measured: Path | None, correlated: float | None) -> dict[str, Any]:
    """The --json object: results by GPU count and strategy, and every figure's source."""
    from aihpc.goodput.strategies import mixes_sources, recovery_path_defaults

    corr = correlated
    if corr is None:
        corr = recovery_path_defaults()["peer"]["correlated_loss_fraction"]
    return {
        "gpu_counts": list(results),
        "measured": None if measured is None else str(measured),
        "correlated_loss_fraction": corr,
        "mixed_sources": any(mixes_sources(row) for row in results.values()),
        "results": {str(n): {s: r.to_json() for s, r in row.items()} for n, row in results.items()},
    }


def _fmt_s(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "∞"
    if seconds >= 120:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.3g} s"


def render_compare(out: dict[str, Any]) -> None:
    """A rich table, one row per GPU count and strategy, then where the figures came from."""
    t = Table(title="goodput by recovery strategy", header_style="bold")
    for col in ("GPUs", "strategy", "ETTR", "interval", "save C / W", "mean recovery"):
        t.add_column(col, justify="left" if col == "strategy" else "right")
    for label in LOSS_COLUMNS.values():
        t.add_column(f"lost: {label}", justify="right")
    sources: dict[str, str] = {}
    for n, row in out["results"].items():
        for d in row.values():
            lost = d["lost_time_fraction"]
            t.add_row(
                f"{int(n):,}",
                d["label"],
                f"{d['ettr']:.1%}",
                _fmt_s(d["checkpoint_interval_s"]),
                f"{_fmt_s(d['blocking_s'])} / {_fmt_s(d['persist_s'])}",
                _fmt_s(d["mean_recovery_s"]),
                *(f"{lost[k]:.1%}" for k in LOSS_COLUMNS),
            )
            for p in d["paths"].values():
                sources[f"{p['path']} detection {_fmt_s(p['detection_s'])}"] = p["detection_source"]
                sources[f"{p['path']} restart {_fmt_s(p['restart_s'])}"] = p["restart_source"]
        t.add_section()
    console.print(t)
    kinds = next(iter(out["results"].values()))["inprocess"]["paths"]
    console.print(
        "paths (in-process restart): "
        + ", ".join(f"{k} → {p['path']} ({p['restore_from']})" for k, p in kinds.items())
    )
    for what, source in sorted(sources.items()):
        console.print(f"  {escape(what)}: {escape(source)}", soft_wrap=True)
    if out["mixed_sources"]:
        console.print(
            "note: the restart figures mix measured and published values; a small measured run "
            "next to an at-scale figure does not rank the strategies."
        )
