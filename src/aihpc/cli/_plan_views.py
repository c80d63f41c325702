"""What estimate and search show beside the numbers: the calibration a plan was priced with, the
goodput columns of a search, and the best plan written out as a run spec."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aihpc._io import write_atomic
from aihpc.cli import _common
from aihpc.runspec import RunSpec
from aihpc.runspec.tomlw import dumps_toml

if TYPE_CHECKING:
    from aihpc.perf.fit.calibration_use import CalibrationUse
    from aihpc.perf.step.estimate import Estimate

__all__ = [
    "goodput_columns",
    "render_calibration",
    "warn_calibration",
    "write_plan",
]

TERM_NAMES = {
    "compute": "compute",
    "recompute": "recompute",
    "tp_comm": "tensor-parallel comm",
    "cp_comm": "context-parallel comm",
    "ep_comm": "expert-parallel all-to-all",
    "pp_comm": "pipeline p2p",
    "dp_comm": "data-parallel comm",
    "pipeline_bubble": "pipeline bubble",
    "optimizer": "optimizer",
    "offload": "offload copies",
}


def _pairs(pairs: Any) -> str:
    return ", ".join(f"{c}/{t}" for c, t in pairs) or "none"


def render_calibration(use: CalibrationUse | None) -> None:
    """Two lines under the plan: the file and what it covers, then what this plan took from it."""
    if use is None:
        return
    from rich.markup import escape

    measured = bool(use.covers or use.gemm_covers)  # [[comm]] / [[gemm]] tables
    parts = []
    if measured or use.efficiency is None:
        covers = _pairs(use.covers)
        if use.gemm_covers:
            covers += f"; GEMM {', '.join(use.gemm_covers)}"
        parts.append(f"covers {covers}")
    if use.efficiency is not None:  # scales fitted to measured runs by `aihpc calibrate --runs`
        parts.append(_efficiency_text(use.efficiency))
    _common.console.print(
        f"calibration: {escape(use.path)} {'; '.join(parts)}", highlight=False, soft_wrap=True
    )
    terms = ", ".join(TERM_NAMES.get(t, t) for t in use.terms) or "none"
    if not measured and use.efficiency is not None:
        _common.console.print(
            f"  step-time terms it changed: {terms}", highlight=False, soft_wrap=True
        )
        return
    used = _pairs(use.used) + (f"; GEMM {', '.join(use.gemm_used)}" if use.gemm_used else "")
    _common.console.print(
        f"  used by this plan: {used} (step-time terms it changed: {terms}); "
        f"from the GPU catalog instead: {_pairs(use.missing)}",
        highlight=False,
        soft_wrap=True,
    )


def _efficiency_text(eff: Any) -> str:
    scales = ", ".join(f"{k} x{v:.3g}" for k, v in eff.scales().items() if v != 1.0)
    text = f"efficiency multipliers {scales or 'all 1'}"
    if eff.num_runs:
        text += f" (fitted to {eff.num_runs} runs"
        if eff.fitted_mape is not None and eff.loo_mape is not None:
            text += f": MAPE {eff.fitted_mape:.1%}, leave-one-out {eff.loo_mape:.1%}"
        text += ")"
    return text


def warn_calibration(use: CalibrationUse | None) -> None:
    from rich.markup import escape

    for text in use.warnings if use is not None else []:
        _common.err_console.print(f"warning: {escape(text)}", highlight=False, soft_wrap=True)


def goodput_columns(
    spec: RunSpec, plans: list[Estimate], tokens: float | None
) -> tuple[list[tuple[str, list[str]]], list[dict[str, Any]]]:
    """The search table's goodput columns and the matching JSON keys, one entry per plan.

    ETTR (and throughput x ETTR, what ``--rank-by goodput`` sorts on) whenever it was asked for;
    with a token budget, the days and GPU-hours to train it, failures and checkpoints included.
    """
    from aihpc.goodput.ettr import goodput_report

    extra: list[dict[str, Any]] = []
    for e in plans:
        rep = goodput_report(spec, e.step_time_s, tokens=tokens)
        row: dict[str, Any] = {
            "ettr": rep.ettr,
            "goodput_tokens_per_s_per_gpu": rep.goodput_tokens_per_s_per_gpu,
        }
        if tokens is not None:
            days = rep.time_to_train_days
            row["time_to_train_days"] = days
            row["gpu_hours"] = None if days is None else days * 24 * spec.cluster.num_gpus
        extra.append(row)
    cols: list[tuple[str, list[str]]] = [
        ("ETTR", [f"{r['ettr']:.1%}" for r in extra]),
        ("goodput tok/s/GPU", [f"{r['goodput_tokens_per_s_per_gpu']:,.1f}" for r in extra]),
    ]
    if tokens is not None:
        cols.append(("days", [f"{r['time_to_train_days']:,.1f}" for r in extra]))
        cols.append(("M GPU-hours", [f"{r['gpu_hours'] / 1e6:,.2f}" for r in extra]))
    return cols, extra


def _rebased(value: str, old_dir: Path, new_dir: Path) -> str:
    """A relative path of the run spec, as seen from where the new file is written."""
    path = Path(value)
    if path.is_absolute():
        return value
    return os.path.relpath((old_dir / path).resolve(), new_dir.resolve())


def write_plan(spec: RunSpec, best: Estimate, path: Path, note: str) -> None:
    """The run spec with its ``[parallel]`` table replaced by ``best``'s complete plan: a file
    ``aihpc estimate`` and ``aihpc train`` read as they are (comments of the original are not
    kept; tomllib drops them)."""
    source = Path(spec.path)
    data = tomllib.loads(source.read_text())
    data["parallel"] = best.plan.as_dict()
    cluster = data.get("cluster", {})
    if spec.cluster.memory_headroom_gib:  # --headroom-gib: the plan was chosen keeping it free
        cluster["memory_headroom_gib"] = spec.cluster.memory_headroom_gib
    if isinstance(cluster.get("calibration"), str):
        cluster["calibration"] = _rebased(cluster["calibration"], source.parent, path.parent)
    header = (
        f"Written by `aihpc search {source}`: {note}.\n"
        "The [parallel] table is the complete plan; every other table is the searched run spec's."
    )
    write_atomic(path, dumps_toml(data, header), "--output")
