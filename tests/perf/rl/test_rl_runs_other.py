"""The measured RL steps of frameworks other than NeMo-RL (perf/fit/data/validation/
rl_runs_other.csv): the same columns as rl_runs.csv, every row held out, named by its source with
its assumptions, and priced by the step model (no expected number: the pricing is the check's
subject, its first result is benchmarks/results/rl_other_rows_first_pricing.txt)."""

from __future__ import annotations

import csv
from importlib import resources
from pathlib import Path

import pytest

from aihpc.perf.fit.rl_validate import validate_rl
from aihpc.runspec.errors import SpecError


def _default_csv(name: str) -> Path:
    return Path(str(resources.files("aihpc.perf.fit") / "data" / "validation" / name))


def _table(name: str) -> tuple[list[str], list[dict[str, str]]]:
    with open(_default_csv(name), newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def test_the_file_has_the_columns_of_the_nemo_rl_table_and_new_ids():
    header, rows = _table("rl_runs_other.csv")
    nemo_header, nemo_rows = _table("rl_runs.csv")
    assert header == nemo_header
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) >= 5
    assert not set(ids) & {r["id"] for r in nemo_rows}  # a second file, not a copy


def test_every_row_is_held_out_sourced_and_priced():
    _, rows = _table("rl_runs_other.csv")
    report = validate_rl(_default_csv("rl_runs_other.csv"))
    assert [r.id for r in report.rows] == [r["id"] for r in rows]
    for row in report.rows:
        assert row.set == "heldout", row.id
        assert len(row.source) > 40, row.id
        assert row.measured_s > 0, row.id
        assert row.predicted_s > 0, row.id
        # the step is built from its phases: none negative, the rollout and the update priced
        assert min(row.phases_s.values()) >= 0, row.id
        assert row.phases_s["rollout"] > 0 and row.phases_s["update"] > 0, row.id
    assert report.mape("heldout") == report.mape()  # every row in the held-out set


def test_the_verl_rows_price_verls_offload_inside_its_phases():
    """A verl row whose script sets offload=True (column ``offload`` verl-megatron) has its
    moves under verl's timers; one that does not (``none``) moves nothing there; NeMo-RL's rows
    keep NeMo-RL's switch."""
    _, rows = _table("rl_runs_other.csv")
    offload = {r["id"]: r["offload"] for r in rows}
    assert set(offload.values()) == {"verl-megatron", "none"}
    report = validate_rl(_default_csv("rl_runs_other.csv"))
    for row in report.rows:
        moves = row.switch_by_timer
        if offload[row.id] == "verl-megatron":
            assert moves["update_actor"] > moves["old_log_prob"] > 0, row.id
        else:
            assert moves.get("update_actor", 0.0) == moves.get("old_log_prob", 0.0) == 0.0
    nemo = validate_rl(_default_csv("rl_runs.csv"))
    assert all("update_actor" not in r.switch_by_timer for r in nemo.rows)


def test_a_row_naming_an_unknown_offload_is_refused_with_its_row_and_field(tmp_path):
    header, rows = _table("rl_runs_other.csv")
    bad = dict(rows[0], id="x", offload="deepspeed")
    path = tmp_path / "rows.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, header)
        writer.writeheader()
        writer.writerow(bad)
    with pytest.raises(SpecError, match=r"row x: rl\.offload") as err:
        validate_rl(path)
    assert err.value.value == "deepspeed" and "verl-megatron" in err.value.allowed


def test_a_row_without_dynamic_batching_runs_its_fixed_micro_batches():
    """verl's rows without dynamic batching (``batching`` unpadded) say their micro-batch size
    (``train_mbs``, the script's ppo_micro_batch_size_per_gpu) and price more micro-batches than
    the same row packed, each the row's own sequences, not a padded length."""
    _, rows = _table("rl_runs_other.csv")
    fixed = [r for r in rows if r["batching"] == "unpadded"]
    assert fixed and all(int(r["train_mbs"]) >= 1 for r in fixed)
    from aihpc.perf.fit.rl_validate import rl_runspec
    from aihpc.perf.rl.batching import batches
    from aihpc.runspec import runspec_from_dict

    spec = runspec_from_dict(rl_runspec(fixed[0]))
    assert spec.plan().micro_batch_size == int(fixed[0]["train_mbs"])
    rl, plan = spec.rl, spec.plan()
    assert batches(rl, plan, 512, "unpadded").microbatches > batches(rl, plan, 512).microbatches
