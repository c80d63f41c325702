"""The VLM validation sets (issue 40): at least 8 published measured runs with their sources
(the whole-run set and the step-level set together; the loose set apart), held-out rows priced
once before the model changed, and the targets (MAPE <= 15%, no row beyond 30%) checked as they
stand."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from aihpc.perf.fit.validate import data_file
from aihpc.perf.fit.vlm_validate import (
    TARGET_VLM_MAPE,
    TARGET_VLM_MAX_ERROR,
    VALIDATED_FILES,
    validate_vlm,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report():  # type: ignore[no-untyped-def]
    return validate_vlm()


def test_at_least_eight_published_runs_each_with_its_source(report) -> None:  # type: ignore[no-untyped-def]
    """The validated set is the whole-run file and the step-level file read together; each
    row's measured figure is its published samples over its published hours and GPUs."""
    assert len(report.rows) >= 8
    rows = [row for name in VALIDATED_FILES for row in csv.DictReader(data_file(name).open())]
    for row, r in zip(rows, report.rows, strict=True):
        assert len(r.source) > 60 and r.measured > 0 and r.predicted > 0
        per_gpu = float(row["samples"]) / (float(row["measured_hours"]) * 3600)
        assert r.id == row["id"] and r.runs_file in VALIDATED_FILES
        assert r.measured == pytest.approx(per_gpu / int(row["num_gpus"]))


def test_held_out_rows_were_priced_once_before_any_change(report) -> None:  # type: ignore[no-untyped-def]
    held = [r for r in report.rows if r.heldout]
    assert len(held) >= 3
    results = ROOT / "benchmarks" / "results"
    first = {
        "vlm_runs.csv": (results / "vlm_heldout_first.md").read_text(),
        "vlm_step_runs.csv": (results / "vlm_step_heldout_first.md").read_text(),
    }
    for r in held:
        assert f"| {r.id} | yes |" in first[r.runs_file]


@pytest.mark.xfail(
    strict=True,
    reason="issue 40's targets are not met yet: the Hugging Face runs (LLaVA's Trainer, NeMo "
    "AutoModel's FSDP2 recipes) lose more per step than the step model prices (data loading on "
    "the step's path, framework host time) and V6 / V7 pad to an estimated text tail that "
    "prices them slow; docs/multimodal.md names what each miss lacks",
)
def test_vlm_targets(report) -> None:  # type: ignore[no-untyped-def]
    assert report.mape <= TARGET_VLM_MAPE
    assert report.max_error <= TARGET_VLM_MAX_ERROR


def test_loose_rows_stay_apart_sourced_and_priced() -> None:
    """The Megatron-LM example's 'approximately 1 day / 11 hours' (restarts every 230 minutes,
    evaluation, checkpoints) sit in their own file, out of the validated set, still priced."""
    loose = validate_vlm(data_file("vlm_loose_runs.csv"))
    main = {r.id for r in validate_vlm().rows}
    assert {r.id for r in loose.rows} == {"V8", "V9"} and not main & {"V8", "V9"}
    for r in loose.rows:
        assert len(r.source) > 60 and r.measured > 0 and r.predicted > 0


STEP_RUNS = "vlm_step_runs.csv"


@pytest.fixture(scope="module")
def step_report():  # type: ignore[no-untyped-def]
    return validate_vlm(data_file(STEP_RUNS))


def test_step_level_rows_are_held_out_sourced_and_were_priced_once(step_report) -> None:  # type: ignore[no-untyped-def]
    """The step-level set (step times, not wall clock): every row held out, named with its
    source, and recorded at its first pricing before any model change."""
    assert len(step_report.rows) >= 3
    first = (ROOT / "benchmarks" / "results" / "vlm_step_heldout_first.md").read_text()
    rows = list(csv.DictReader(data_file(STEP_RUNS).open()))
    for row, r in zip(rows, step_report.rows, strict=True):
        assert r.heldout and len(r.source) > 60 and f"| {r.id} | yes |" in first
        step_s = float(row["measured_hours"]) * 3600
        assert r.measured == pytest.approx(float(row["samples"]) / step_s / int(row["num_gpus"]))


def test_step_rows_carry_their_cp_and_sequence_length(step_report) -> None:  # type: ignore[no-untyped-def]
    rows = {row["id"]: row for row in csv.DictReader(data_file(STEP_RUNS).open())}
    for r in step_report.rows:
        plan = r.estimate.llm.plan
        assert plan.cp == int(rows[r.id]["cp"] or 1)
        assert plan.tp * plan.pp * plan.cp * plan.dp == r.num_gpus


def test_a_bad_sequence_length_cell_names_its_row_and_column(tmp_path: Path) -> None:
    from aihpc.runspec.errors import SpecError

    text = data_file(STEP_RUNS).read_text().splitlines()
    head = text[0].split(",")
    bad = next(line for line in text[1:] if line.startswith("M2,"))
    fields = next(csv.reader([bad]))
    fields[head.index("seq_length")] = "long"
    out = tmp_path / "runs.csv"
    with out.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(head)
        w.writerow(fields)
    with pytest.raises(SpecError) as err:
        validate_vlm(out)
    assert err.value.field == "row M2: seq_length" and err.value.value == "long"


def test_fsdp2_rows_are_priced_with_eager_dtensor_dispatch(step_report) -> None:  # type: ignore[no-untyped-def]
    """NeMo AutoModel's recipes run PyTorch FSDP2 eagerly: the column reaches the spec, and the
    eager FSDP2 terms (a gather per unit and micro-batch, their copies) cost time, not less."""
    import dataclasses

    from aihpc.perf.fit.vlm_validate import row_spec
    from aihpc.perf.multimodal.estimate import estimate_vlm

    rows = {row["id"]: row for row in csv.DictReader(data_file(STEP_RUNS).open())}
    for r in step_report.rows:
        spec = row_spec(rows[r.id])
        assert spec.training.dtensor_dispatch == (rows[r.id]["dtensor_dispatch"] or "none")
        if spec.training.dtensor_dispatch == "eager":
            plain = dataclasses.replace(spec.training, dtensor_dispatch="none")
            before = estimate_vlm(dataclasses.replace(spec, training=plain))
            assert r.estimate.step_time_s > before.step_time_s
