"""Check the model against published measured runs (``data/validation``).

Throughput rows: predicted vs measured tokens/s/GPU; a row whose plan cells are empty gets the
best searched completion with its given fields fixed (what a user of the planner would run).
Memory rows: Korthikanti et al. 2022 profiled components and torchtitan peak reserved memory.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

from aihpc.perf.fit.runs_csv import (
    RUNS_COLUMNS,
    cell,
    measured,
    measured_throughput,
    read_table,
    row_runspec,
)
from aihpc.perf.search.ranking import search_plans
from aihpc.perf.step.estimate import Estimate, estimate_plan
from aihpc.perf.step.memory import GiB
from aihpc.perf.step.params import DEFAULT_PARAMS, ModelParams
from aihpc.runspec.calibration import Calibration
from aihpc.runspec.errors import SpecError
from aihpc.runspec.parallel import ParallelPlan, PartialPlan

__all__ = ["MemoryRow", "ThroughputRow", "ValidationReport", "validate"]

# Targets of issue #2; a test enforces them.
TARGET_MAPE = 0.10
TARGET_MAX_ERROR = 0.25
TARGET_KORTHIKANTI = 0.10
TARGET_TORCHTITAN = 0.15
# Targets of issue #17 on the MoE development set (moe_runs.csv).
TARGET_MOE_MAPE = 0.15
TARGET_MOE_MAX_ERROR = 0.30


def data_file(name: str) -> Path:
    return Path(str(resources.files("aihpc.perf.fit").joinpath(f"data/validation/{name}")))


@dataclass(frozen=True)
class ThroughputRow:
    id: str
    source: str
    model: str
    num_gpus: int
    measured: float
    predicted: float
    searched: bool
    plan: ParallelPlan
    estimate: Estimate
    measured_memory_gib: float | None

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured


@dataclass(frozen=True)
class MemoryRow:
    id: str
    source: str
    component: str
    measured_gib: float
    predicted_gib: float

    @property
    def error(self) -> float:
        return (self.predicted_gib - self.measured_gib) / self.measured_gib


@dataclass
class ValidationReport:
    rows: list[ThroughputRow]
    memory: list[MemoryRow]
    heldout: bool = False  # rows kept out of the model's development (heldout_runs.csv)
    moe: bool = False  # the MoE development set (moe_runs.csv), with its own targets
    user: bool = False  # the user's own runs: no target of the project's applies
    calibration: str = ""  # the calibration every row was priced with (its path), if any

    def mape_by_source(self) -> dict[str, float]:
        groups: dict[str, list[float]] = {}
        for r in self.rows:
            groups.setdefault(source_key(r.source), []).append(abs(r.error))
        return {k: statistics.fmean(v) for k, v in groups.items()}

    @property
    def mape(self) -> float:
        return statistics.fmean(abs(r.error) for r in self.rows)

    @property
    def max_error(self) -> float:
        return max(abs(r.error) for r in self.rows)

    def memory_max_error(self, kind: str) -> float:
        errs = [abs(m.error) for m in self.memory if memory_kind(m) == kind]
        return max(errs) if errs else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "rows": [
                {
                    "id": r.id,
                    "source": r.source,
                    "model": r.model,
                    "num_gpus": r.num_gpus,
                    "measured_tokens_per_s_per_gpu": r.measured,
                    "predicted_tokens_per_s_per_gpu": r.predicted,
                    "error": r.error,
                    "searched": r.searched,
                    "plan": r.plan.as_dict(),
                }
                for r in self.rows
            ],
            "mape_by_source": self.mape_by_source(),
            "mape": self.mape,
            "max_abs_error": self.max_error,
            "memory": [
                {
                    "id": m.id,
                    "component": m.component,
                    "measured_gib": m.measured_gib,
                    "predicted_gib": m.predicted_gib,
                    "error": m.error,
                }
                for m in self.memory
            ],
            "memory_max_abs_error": {
                "peak_reserved": max((abs(m.error) for m in self.memory), default=0.0)
            }
            if self.user
            else {k: self.memory_max_error(k) for k in ("korthikanti", "torchtitan")},
            "targets": None
            if self.user
            else {"mape": TARGET_MOE_MAPE, "max_abs_error": TARGET_MOE_MAX_ERROR}
            if self.moe
            else {
                "mape": TARGET_MAPE,
                "max_abs_error": TARGET_MAX_ERROR,
                "korthikanti_memory": TARGET_KORTHIKANTI,
                "torchtitan_memory": TARGET_TORCHTITAN,
            },
            "targets_met": None if self.user else self.targets_met,
            "passed": None if self.user else self.passed,
            "heldout": self.heldout,
            "user_runs": self.user,
            "calibration": self.calibration or None,
            **({"moe": True} if self.moe else {}),
        }

    @property
    def targets_met(self) -> dict[str, bool]:
        """Each target of issue #2 on its own (``passed`` is all of them); issue #17's for the
        MoE set."""
        if self.moe:
            return {
                "mape": self.mape <= TARGET_MOE_MAPE,
                "max_abs_error": self.max_error <= TARGET_MOE_MAX_ERROR,
            }
        return {
            "mape": self.mape <= TARGET_MAPE,
            "max_abs_error": self.max_error <= TARGET_MAX_ERROR,
            "korthikanti_memory": self.memory_max_error("korthikanti") <= TARGET_KORTHIKANTI,
            "torchtitan_memory": self.memory_max_error("torchtitan") <= TARGET_TORCHTITAN,
        }

    @property
    def passed(self) -> bool:
        return all(self.targets_met.values())


def source_key(source: str) -> str:
    for key in ("Narayanan", "Korthikanti", "Megatron-LM README", "NeMo", "torchtitan"):
        if key in source:
            return {"Megatron-LM README": "Megatron-Core"}.get(key, key)
    return source.split(" ")[0] or "(no source)"


def memory_kind(row: MemoryRow) -> str:
    return "torchtitan" if "torchtitan" in row.source else "korthikanti"


def _complete(partial: PartialPlan) -> bool:
    return all(
        getattr(partial, f) is not None
        for f in (
            "tp",
            "pp",
            "vpp",
            "cp",
            "dp",
            "sequence_parallel",
            "zero_stage",
            "recompute",
            "micro_batch_size",
            "global_batch_size",
        )
    )


def predict_row(
    row: dict[str, str],
    params: ModelParams = DEFAULT_PARAMS,
    calibration: Calibration | None = None,
) -> ThroughputRow:
    spec = row_runspec(row)
    if calibration is not None:
        spec = replace(spec, cluster=replace(spec.cluster, calibration=calibration))
    if _complete(spec.parallel):
        est = estimate_plan(spec.model, spec.cluster, spec.plan(), spec.training, params)
        searched = False
    else:
        result = search_plans(
            spec.model, spec.cluster, spec.parallel, spec.training, top=1, params=params, explain=1
        )
        if result.plans:
            est = result.plans[0]
        elif result.rejected_best:  # the run happened, so estimate it even if we think it OOMs
            est = result.rejected_best[0].estimate
        else:
            raise SpecError(
                f"validation row {row['id']}", "plan", "no valid completion of the published plan"
            )
        searched = True
    mem = cell(row, "measured_memory_gib")
    return ThroughputRow(
        row["id"],
        cell(row, "source"),
        spec.model.name,
        spec.cluster.num_gpus,
        measured_throughput(row, spec, est.plan.global_batch_size),
        est.tokens_per_s_per_gpu,
        searched,
        est.plan,
        est,
        measured(row, "measured_memory_gib") if mem else None,
    )


def korthikanti_memory(
    runs: dict[str, dict[str, str]], mem_row: dict[str, str], params: ModelParams
) -> list[MemoryRow]:
    """The three profiled components of Korthikanti Fig. 1 for one configuration."""
    from aihpc.perf.step.batch_memory import memory_breakdown

    spec = row_runspec(runs[mem_row["config_row"]])
    base = spec.plan()
    out = []
    cases = [
        ("weights_and_optimizer_gib", replace(base, sequence_parallel=True, recompute="selective")),
        (
            "activations_no_recompute_no_sp_gib",
            replace(base, sequence_parallel=False, recompute="none"),
        ),
        (
            "activations_sp_selective_gib",
            replace(base, sequence_parallel=True, recompute="selective"),
        ),
    ]
    for column, plan in cases:
        mb = memory_breakdown(spec.model, spec.cluster, plan, spec.training, params)
        value = (
            mb.weights + mb.gradients + mb.optimizer
            if column.startswith("weights")
            else mb.activations
        )
        out.append(
            MemoryRow(
                mem_row["id"],
                mem_row["source"],
                column.removesuffix("_gib"),
                measured(mem_row, column),
                value / GiB,
            )
        )
    return out


MEMORY_COLUMNS = (
    "id",
    "config_row",
    "source",
    "weights_and_optimizer_gib",
    "activations_no_recompute_no_sp_gib",
    "activations_sp_selective_gib",
)


def _checked(path: Path, row: dict[str, str], func: Callable[[], Any]) -> Any:
    """Run ``func`` on one row; a malformed cell becomes an error naming the file and row."""
    try:
        return func()
    except (ValueError, KeyError, TypeError) as err:
        if isinstance(err, SpecError):
            raise SpecError(
                f"{path} row {row.get('id')}: {err.field}", err.value, err.allowed
            ) from err
        raise SpecError(f"{path} row {row.get('id')}", "cell", f"malformed: {err}") from err


def validate(
    runs_csv: Path | None = None,
    memory_csv: Path | None = None,
    params: ModelParams = DEFAULT_PARAMS,
    progress: Callable[[str], None] | None = None,
    heldout: bool = False,
    moe: bool = False,
    calibration: Calibration | None = None,
) -> ValidationReport:
    """Model vs published runs. ``heldout``: the project's held-out runs (published runs that
    are not in the shared set the model was developed on), without the Korthikanti memory
    rows; held-out runs that publish a peak memory still get theirs. A ``runs_csv`` of the
    user's own gets memory rows only from ``memory_csv`` when one is given, and every row is
    priced with ``calibration`` when one is given."""
    user = runs_csv is not None and not (heldout or moe)
    with_memory_csv = memory_csv is not None or runs_csv is None
    if heldout:
        runs_csv = data_file("heldout_runs.csv")
    if moe:  # issue #17's MoE development set (shared/validation/moe_runs.md), no memory rows
        runs_csv = data_file("moe_runs.csv")
    runs_csv = runs_csv or data_file("published_runs.csv")
    memory_csv = memory_csv or data_file("published_memory.csv")
    runs = read_table(runs_csv, RUNS_COLUMNS, "runs CSV")
    rows = []
    for row in runs:
        if progress is not None:
            progress(row["id"])
        rows.append(_checked(runs_csv, row, lambda row=row: predict_row(row, params, calibration)))
    memory: list[MemoryRow] = []
    by_id = {r["id"]: r for r in runs}
    mem_rows = read_table(memory_csv, MEMORY_COLUMNS, "memory CSV") if with_memory_csv else []
    for mem_row in [] if heldout or moe else mem_rows:
        if mem_row["config_row"] not in by_id:
            raise SpecError(
                f"{memory_csv} row {mem_row['id']}: config_row",
                mem_row["config_row"],
                "must name a row of the runs CSV",
            )
        memory.extend(
            _checked(memory_csv, mem_row, lambda m=mem_row: korthikanti_memory(by_id, m, params))
        )
    for r in rows:
        if r.measured_memory_gib is not None:
            total = r.estimate.memory.total / GiB
            memory.append(MemoryRow(r.id, r.source, "peak_reserved", r.measured_memory_gib, total))
    cal_path = (calibration.path or calibration.source) if calibration is not None else ""
    return ValidationReport(rows, memory, heldout, moe, user, cal_path)
