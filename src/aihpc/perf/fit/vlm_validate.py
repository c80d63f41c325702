"""The vision-language planner against published measured VLM training runs: predicted vs
measured samples per second per GPU. The validated set is two files read together:
``data/validation/vlm_runs.csv`` (a run's samples over its published wall-clock hours and GPUs:
the LLaVA README's training times) and ``vlm_step_runs.csv`` (a published step time: the
global batch over the step's seconds). ``vlm_loose_runs.csv`` holds published figures too loose
to validate against (docs/multimodal.md says why), priced with ``--runs``. Rows marked
``heldout`` were priced once before any change made after seeing them
(benchmarks/results/vlm_heldout_first.md, vlm_step_heldout_first.md) and stay in the set.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aihpc.perf.fit.runs_csv import cell, measured, read_table
from aihpc.perf.fit.validate import data_file
from aihpc.perf.multimodal.estimate import VlmEstimate, estimate_vlm
from aihpc.runspec.errors import SpecError
from aihpc.runspec.runspec import RunSpec, runspec_from_dict

__all__ = [
    "TARGET_VLM_MAPE",
    "TARGET_VLM_MAX_ERROR",
    "VALIDATED_FILES",
    "VlmReport",
    "VlmRow",
    "validate_vlm",
]

# Targets of issue 40; a test enforces them.
TARGET_VLM_MAPE = 0.15
TARGET_VLM_MAX_ERROR = 0.30

VLM_COLUMNS = ("id", "vlm", "gpu", "num_gpus", "global_batch_size", "samples", "measured_hours")
_PLAN_INT = ("tp", "pp", "cp", "dp", "micro_batch_size", "global_batch_size", "zero_stage")
_FLAGS = ("packing", "freeze_encoder", "freeze_projector", "freeze_llm", "predecoded")


@dataclass(frozen=True)
class VlmRow:
    id: str
    source: str
    model: str
    num_gpus: int
    heldout: bool
    measured: float  # samples / s / GPU
    estimate: VlmEstimate
    runs_file: str = ""  # the CSV the row came from

    @property
    def predicted(self) -> float:
        return self.estimate.samples_per_s_per_gpu

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured


@dataclass
class VlmReport:
    rows: list[VlmRow]

    @property
    def mape(self) -> float:
        return statistics.fmean(abs(r.error) for r in self.rows)

    @property
    def max_error(self) -> float:
        return max(abs(r.error) for r in self.rows)

    def subset_mape(self, heldout: bool) -> float | None:
        errs = [abs(r.error) for r in self.rows if r.heldout == heldout]
        return statistics.fmean(errs) if errs else None

    @property
    def targets_met(self) -> dict[str, bool]:
        return {
            "mape": self.mape <= TARGET_VLM_MAPE,
            "max_abs_error": self.max_error <= TARGET_VLM_MAX_ERROR,
        }

    @property
    def passed(self) -> bool:
        return all(self.targets_met.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "rows": [
                {
                    "id": r.id,
                    "source": r.source,
                    "model": r.model,
                    "num_gpus": r.num_gpus,
                    "heldout": r.heldout,
                    "runs_file": r.runs_file,
                    "measured_samples_per_s_per_gpu": r.measured,
                    "predicted_samples_per_s_per_gpu": r.predicted,
                    "error": r.error,
                    "placement": r.estimate.placement,
                    "plan": r.estimate.llm.plan.as_dict(),
                    "time_s": r.estimate.time_s,
                }
                for r in self.rows
            ],
            "mape": self.mape,
            "max_abs_error": self.max_error,
            "mape_development": self.subset_mape(False),
            "mape_heldout": self.subset_mape(True),
            "targets": {"mape": TARGET_VLM_MAPE, "max_abs_error": TARGET_VLM_MAX_ERROR},
            "targets_met": self.targets_met,
            "passed": self.passed,
            "vlm": True,
        }


def _bool(row: dict[str, str], key: str) -> bool:
    text = cell(row, key).lower()
    if text not in ("true", "false"):
        raise SpecError(key, cell(row, key), "expected true or false")
    return text == "true"


def _number_or_table(row: dict[str, str], key: str) -> Any:
    """A cell holding a number or a JSON distribution ({"values": ..., "weights": ...})."""
    text = cell(row, key)
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise SpecError(key, text, "a number or a JSON distribution") from None


def row_spec(row: dict[str, str]) -> RunSpec:
    """A VLM validation row as a run spec; a malformed cell is a SpecError naming its column."""
    parallel: dict[str, Any] = {}
    for k in _PLAN_INT:
        if cell(row, k):
            try:
                parallel[k] = int(cell(row, k))
            except ValueError:
                raise SpecError(k, cell(row, k), "expected a whole number") from None
    if cell(row, "recompute"):
        parallel["recompute"] = cell(row, "recompute")
    if cell(row, "sequence_parallel"):
        parallel["sequence_parallel"] = _bool(row, "sequence_parallel")
    training: dict[str, Any] = {"precision": cell(row, "precision") or "bf16"}
    for text in ("attention", "cross_entropy", "zero3_gather", "dtensor_dispatch"):
        if cell(row, text):
            training[text] = cell(row, text)
    for flag in ("fused_kernels", "log_params_norm", "deterministic"):
        if cell(row, flag):
            training[flag] = _bool(row, flag)
    mm: dict[str, Any] = {
        "images_per_sample": _number_or_table(row, "images_per_sample"),
        "image_tokens": _number_or_table(row, "image_tokens"),
        "text_tokens": {
            "mean": measured(row, "text_tokens_mean"),
            "p99": measured(row, "text_tokens_p99"),
        },
    }
    for flag in _FLAGS:
        if cell(row, flag):
            mm[flag] = _bool(row, flag)
    for text in ("padding", "placement", "image_processor"):
        if cell(row, text):
            mm[text] = cell(row, text)
    if cell(row, "loader_workers"):
        try:
            mm["loader_workers"] = int(cell(row, "loader_workers"))
        except ValueError:
            raise SpecError(
                "loader_workers", cell(row, "loader_workers"), "a whole number"
            ) from None
    try:
        gpus = int(cell(row, "num_gpus"))
    except ValueError:
        raise SpecError("num_gpus", cell(row, "num_gpus"), "expected a whole number") from None
    model: dict[str, Any] = {"preset": cell(row, "vlm")}
    if cell(row, "seq_length"):  # the run's sequence length where it differs from the preset's
        try:
            model["seq_length"] = int(cell(row, "seq_length"))
        except ValueError:
            raise SpecError("seq_length", cell(row, "seq_length"), "a whole number") from None
    return runspec_from_dict(
        {
            "model": model,
            "cluster": {"gpu": cell(row, "gpu"), "num_gpus": gpus},
            "parallel": parallel,
            "training": training,
            "multimodal": mm,
        }
    )


VALIDATED_FILES = ("vlm_runs.csv", "vlm_step_runs.csv")


def validate_vlm(path: Path | None = None) -> VlmReport:
    """Price every row of a VLM runs file (by default the validated set: both files)."""
    paths = [path] if path is not None else [data_file(name) for name in VALIDATED_FILES]
    out: list[VlmRow] = []
    for p in paths:
        out.extend(_priced_rows(p))
    ids = [r.id for r in out]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise SpecError("VLM runs: id", dup, "every row needs an id of its own across the files")
    return VlmReport(out)


def _priced_rows(path: Path) -> list[VlmRow]:
    rows = read_table(path, VLM_COLUMNS, "VLM runs")
    out: list[VlmRow] = []
    for row in rows:
        rid = cell(row, "id")
        try:
            spec = row_spec(row)
            est = estimate_vlm(spec)
        except SpecError as err:
            raise SpecError(f"row {rid}: {err.field}", err.value, err.allowed) from None
        gpus = spec.cluster.num_gpus
        per_gpu = measured(row, "samples") / (measured(row, "measured_hours") * 3600) / gpus
        out.append(
            VlmRow(
                id=rid,
                source=cell(row, "source"),
                model=cell(row, "vlm"),
                num_gpus=gpus,
                heldout=cell(row, "heldout").lower() == "true",
                measured=per_gpu,
                estimate=est,
                runs_file=path.name,
            )
        )
    return out
