"""The run directory's records checked line by line without a run (runtime/records.py): every
damaged form of a metrics, events or summary record is named with its field, its value and what
is allowed, skipped, and kept beside the file; the forms a resume meets end to end are in
test_damaged_records.py."""

from __future__ import annotations

import json
import logging

import pytest

from aihpc.runspec import load_runspec
from aihpc.runtime.records import (
    event_problem,
    lost_steps,
    metrics_problem,
    repair_records,
    steps_text,
    summary_problem,
)
from aihpc.runtime.rundir import finished_summary, read_summary, trim_metrics, write_summary

SHA = "ab" * 32
METRIC = {"step": 3, "loss": 1.5, "loss_hex": (1.5).hex()}
EVENT = {"event": "loaded", "rank": 0, "attempt": 0, "time_unix": 1.0, "step": 4}
SUMMARY = {"final_step": 6, "resumed_from_step": 4, "final_loss": 1.5, "state_sha256": SHA}


@pytest.mark.parametrize(
    ("record", "says"),
    [
        ({**METRIC, "step": None}, "step = null, not an integer"),
        ({**METRIC, "step": "3"}, 'step = "3", not an integer'),
        ({**METRIC, "step": True}, "step = true, not an integer"),
        ({**METRIC, "step": 3.0}, "step = 3.0, not an integer"),
        ({**METRIC, "step": 0}, "step = 0, not an integer >= 1"),
        ({**METRIC, "loss_hex": 1.5}, "loss_hex = 1.5, not a float in hex"),
        ({**METRIC, "loss_hex": "0x1.8zz"}, 'loss_hex = "0x1.8zz", not a float in hex'),
        (
            {k: v for k, v in METRIC.items() if k != "loss_hex"},
            "loss_hex = null, not a float in hex",
        ),
        ([1, 2], "an array, not an object"),
        ("x", "a string, not an object"),
    ],
)
def test_metrics_line_problems(record, says):
    assert (
        metrics_problem(METRIC) is None and metrics_problem({**METRIC, "loss_hex": "nan"}) is None
    )
    assert metrics_problem(record) == says


@pytest.mark.parametrize(
    ("record", "says"),
    [
        ({**EVENT, "event": None}, "event = null, not an event name"),
        ({**EVENT, "event": ""}, 'event = "", not an event name'),
        ({**EVENT, "rank": -1}, "rank = -1, not an integer >= 0"),
        ({**EVENT, "attempt": "0"}, 'attempt = "0", not an integer'),
        ({**EVENT, "time_unix": "now"}, 'time_unix = "now", not a finite number'),
        ({**EVENT, "step": None}, "step = null, not an integer"),
        (7, "a number, not an object"),
    ],
)
def test_events_line_problems(record, says):
    assert event_problem(EVENT) is None
    assert event_problem({k: v for k, v in EVENT.items() if k != "step"}) is None
    assert event_problem(record) == says


@pytest.mark.parametrize(
    ("summary", "says"),
    [
        ({**SUMMARY, "final_step": None}, "final_step = null, not an integer"),
        ({**SUMMARY, "final_step": "6"}, 'final_step = "6", not an integer'),
        ({**SUMMARY, "resumed_from_step": -2}, "resumed_from_step = -2, not an integer >= 0"),
        ({**SUMMARY, "final_loss": "1.5"}, 'final_loss = "1.5", not a finite number or null'),
        ({**SUMMARY, "state_sha256": None}, "state_sha256 = null, not 64 hex digits"),
        ({**SUMMARY, "history": {"a": 1}}, 'history = {"a": 1}, not a list of objects'),
        ({**SUMMARY, "history": [3]}, "history = [3], not a list of objects"),
        ([], "an array, not an object"),
    ],
)
def test_summary_problems(tmp_path, summary, says, caplog):
    assert (
        summary_problem(SUMMARY) is None
        and summary_problem({**SUMMARY, "final_loss": None}) is None
    )
    assert summary_problem(summary) == says
    # read, it is no summary; a finished-run check or a new summary keeps it aside, named once
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert read_summary(tmp_path) is None
    spec = tmp_path / "run.toml"
    spec.write_text('[model]\npreset = "tiny-llama"\n[cluster]\ngpu = "h100-sxm"\nnum_gpus = 1\n')
    with caplog.at_level(logging.WARNING, logger="aihpc.runtime"):
        assert finished_summary(tmp_path, load_runspec(spec)) is None
        write_summary(tmp_path, dict(SUMMARY))
    named = [r.getMessage() for r in caplog.records if "summary.json" in r.getMessage()]
    assert named == [f"summary.json: {says}; kept as summary.json.damaged, and a new summary is "
                     "written from the checkpoint (the earlier sessions it listed are not carried "
                     "over)"]  # fmt: skip
    assert json.loads((tmp_path / "summary.json.damaged").read_text()) == summary
    assert read_summary(tmp_path) == SUMMARY


def test_a_summary_that_is_not_json_or_a_folder_is_kept_aside(tmp_path):
    (tmp_path / "summary.json").write_bytes(b'{"final_step": \xff')
    write_summary(tmp_path, dict(SUMMARY))
    assert (tmp_path / "summary.json.damaged").read_bytes() == b'{"final_step": \xff'
    (tmp_path / "summary.json").unlink()
    (tmp_path / "summary.json").mkdir()
    write_summary(tmp_path, dict(SUMMARY))
    assert (tmp_path / "summary.json.damaged.2").is_dir() and read_summary(tmp_path) == SUMMARY


def line(**fields) -> bytes:
    return json.dumps({**METRIC, **fields}).encode()


def test_many_damaged_lines_are_counted_and_a_torn_tail_kept(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = [line(step=s) for s in range(1, 4)]
    bad = [line(step=None)] * 8
    path.write_bytes(b"\n".join([good[0], *bad, good[1], good[2]]) + b"\n" + b'{"step": 4, "lo')
    notes = repair_records(path, metrics_problem)
    assert notes[:5] == [
        f"metrics.jsonl line {n}: step = null, not an integer; line skipped (kept in "
        "metrics.jsonl.damaged)"
        for n in range(2, 7)
    ]
    assert notes[5:] == [
        "metrics.jsonl: 3 more damaged lines skipped (kept in metrics.jsonl.damaged)",
        "metrics.jsonl: cut a torn last line of 15 bytes (kept in metrics.jsonl.damaged)",
    ]
    assert path.read_bytes() == b"".join(g + b"\n" for g in good)
    kept = (tmp_path / "metrics.jsonl.damaged").read_bytes()
    assert kept == b"".join(b + b"\n" for b in bad) + b'{"step": 4, "lo\n'
    assert repair_records(path, metrics_problem) == []  # repaired: nothing left to say


def test_trim_keeps_the_first_of_a_repeated_step_and_says_what_is_lost(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"\n".join([line(step=1), line(step=3), line(step=3, loss_hex="0x0p+0"),
                                 line(step=6), line(step=8)]) + b"\n")  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="aihpc.runtime"):
        assert trim_metrics(path, 7) == [[2, 2], [4, 5], [7, 7]]
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 3, 6]
    assert json.loads(path.read_text().splitlines()[1])["loss_hex"] == (1.5).hex()
    assert caplog.messages == [
        "metrics.jsonl has gaps: the loss history of step(s) 2, 4-5, 7, before the resume "
        "from step 7, is lost"
    ]


def test_lost_steps_as_ranges():
    assert lost_steps([], 0) == [] and lost_steps([1, 2, 3], 3) == []
    assert lost_steps([2, 5], 6) == [[1, 1], [3, 4], [6, 6]]
    assert steps_text([[1, 1], [3, 4]]) == "1, 3-4"
