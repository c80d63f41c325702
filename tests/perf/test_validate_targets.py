"""Issue #2 targets on the published runs. The model does not meet them yet (see
docs/performance-model.md for each miss and its cause); strict xfail turns green-to-red the day
it does, so the marker must then be removed."""

import csv

import pytest

from aihpc.perf.validate import (
    TARGET_MAPE,
    TARGET_MAX_ERROR,
    TARGET_TORCHTITAN,
    data_file,
    validate,
)


@pytest.fixture(scope="module")
def report():
    return validate()


def test_every_row_is_predicted(report) -> None:
    with open(data_file("published_runs.csv"), newline="") as fh:
        assert len(report.rows) == len(list(csv.DictReader(fh))) > 50
    for r in report.rows:
        assert r.predicted > 0 and r.estimate.step_time_s > 0
        # the searched completion keeps every published plan field
        assert r.plan.global_batch_size > 0


@pytest.mark.xfail(
    strict=True,
    reason="ZeRO-3 (DeepSpeed 2021) and torchtitan rows are "
    "over-predicted; overall MAPE is above 10%",
)
def test_throughput_targets(report) -> None:
    assert report.mape <= TARGET_MAPE
    assert report.max_error <= TARGET_MAX_ERROR


@pytest.mark.xfail(
    strict=True,
    reason="torchtitan peak *reserved* memory includes the caching "
    "allocator's reserve, which the model does not predict",
)
def test_torchtitan_memory_target(report) -> None:
    assert report.memory_max_error("torchtitan") <= TARGET_TORCHTITAN
