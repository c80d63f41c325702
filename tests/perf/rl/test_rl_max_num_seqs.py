"""``[rl.rollout] max_num_seqs`` (vLLM's cap on the sequences an engine runs at once): the
engines run no more than it, the rest wait in the queue, so a cap below an engine's share of the
step lengthens the rollout; a validation row's ``rollout_max_num_seqs`` and a verl config's
``rollout.max_num_seqs`` set it."""

from __future__ import annotations

import csv
from importlib import resources
from pathlib import Path

import pytest
from rl_base_spec import base_spec

from aihpc.interop.verl import import_verl
from aihpc.perf.fit.rl_validate import validate_rl
from aihpc.perf.rl import estimate_rl
from aihpc.runspec import SpecError


def test_the_cap_bounds_the_engines_batch_and_costs_time_only_when_it_binds():
    free = estimate_rl(base_spec())  # 2,048 samples over 16 engines of tp 2: 128 each
    assert free.rollout.slots == 128
    loose = estimate_rl(base_spec(rollout={"tp": 2, "max_num_seqs": 1024}))
    assert loose.rollout.slots == 128 and loose.step_time_s == pytest.approx(free.step_time_s)
    capped = estimate_rl(base_spec(rollout={"tp": 2, "max_num_seqs": 32}))
    assert capped.rollout.slots == 32
    assert capped.phases_s["rollout"] > 1.5 * free.phases_s["rollout"]
    assert capped.phases_s["update"] == pytest.approx(free.phases_s["update"])
    with pytest.raises(SpecError) as err:
        base_spec(rollout={"tp": 2, "max_num_seqs": 0})
    assert err.value.field == "rl.rollout.max_num_seqs"


def test_a_rows_column_sets_the_cap(tmp_path: Path):
    src = Path(str(resources.files("aihpc.perf.fit") / "data" / "validation" / "rl_runs.csv"))
    with open(src, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        header, rows = list(reader.fieldnames or []), list(reader)
    (row,) = [r for r in rows if r["id"] == "nemorl06-q30-32-1off"]
    caps = {}
    for cap in ("", "64"):
        path = tmp_path / f"rows{cap}.csv"
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, header)
            writer.writeheader()
            writer.writerow(dict(row, rollout_max_num_seqs=cap))
        (priced,) = validate_rl(path).rows
        caps[cap] = priced.phases_s["rollout"]
    assert caps["64"] > caps[""]


def test_verl_passes_its_rollout_max_num_seqs():
    text = (
        "python3 -m verl.trainer.main_ppo actor_rollout_ref.model.path=Qwen/Qwen3-30B-A3B "
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"
    )
    default = import_verl(text, response_len=500).tables["rl"]["rollout"]
    assert default["max_num_seqs"] == 256  # verl's default since e9405d7 (2026-01-24)
    set_ = import_verl(text + " actor_rollout_ref.rollout.max_num_seqs=64", response_len=500)
    assert set_.spec().rl.rollout.max_num_seqs == 64
