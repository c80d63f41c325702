"""Issue #2 targets on the published runs. The model does not meet them yet (see
docs/performance-model.md for each miss and its cause); strict xfail turns green-to-red the day
it does, so the marker must then be removed."""

import csv
from pathlib import Path

import pytest

from aihpc.cli.validate import validation_table
from aihpc.perf.fit.validate import (
    TARGET_MAPE,
    TARGET_MAX_ERROR,
    TARGET_TORCHTITAN,
    data_file,
    validate,
)


@pytest.fixture(scope="module")
def report():
    return validate()


def test_every_row_is_predicted_with_its_published_plan(report) -> None:
    with open(data_file("published_runs.csv"), newline="") as fh:
        published = {r["id"]: r for r in csv.DictReader(fh)}
    assert len(report.rows) == len(published) > 50
    for r in report.rows:
        assert r.predicted > 0 and r.estimate.step_time_s > 0
        row = published[r.id]
        for field in (
            "tp",
            "pp",
            "vpp",
            "cp",
            "dp",
            "zero_stage",
            "micro_batch_size",
            "global_batch_size",
        ):
            if row[field]:  # a published field is never changed by the search
                assert getattr(r.plan, field) == int(row[field]), (r.id, field)
        if row["recompute"]:
            assert r.plan.recompute == row["recompute"]


def test_throughput_mape_target(report) -> None:
    assert report.mape <= TARGET_MAPE


@pytest.mark.xfail(
    strict=True,
    reason=(
        "three rows worse than 25%: torchtitan CP 4 and CP 8 on one node (I08, I09) and its 405B"
        " CP 8 async-TP row (I15, +27%: its CP 1 row I14 is +3.7%)"
    ),
)
def test_throughput_worst_row_target(report) -> None:
    assert report.max_error <= TARGET_MAX_ERROR


def test_docs_quote_the_validation_table_of_this_commit(report) -> None:
    """docs/performance-model.md must show exactly what `aihpc validate` prints today."""
    docs = Path(__file__).resolve().parents[2] / "docs" / "performance-model.md"
    assert validation_table(report) in docs.read_text(encoding="utf-8")


def test_torchtitan_memory_target(report) -> None:
    assert report.memory_max_error("torchtitan") <= TARGET_TORCHTITAN


@pytest.mark.parametrize("name", ["published_runs.csv", "heldout_runs.csv"])
def test_step_time_and_throughput_are_one_measurement(name: str) -> None:
    """Each row's step time and tokens/s/GPU are two views of one measurement (the data README):
    global batch x sequence = step x GPUs x tokens/s/GPU, to the rounding of the cells. A row
    converted wrongly from TFLOP/s, samples/s or seconds per iteration fails here."""
    with open(data_file(name), newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert rows
    for r in rows:
        tokens = int(r["global_batch_size"]) * int(r["seq_length"])
        done = (
            float(r["measured_step_time_s"])
            * int(r["num_gpus"])
            * float(r["measured_tokens_per_s_per_gpu"])
        )
        assert done == pytest.approx(tokens, rel=2e-3), r["id"]
