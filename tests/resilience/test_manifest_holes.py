"""The manifest is the whole truth about a checkpoint: a manifest that lists nothing, a file it
does not list, a deleted MANIFEST.json, a LATEST that names nothing, and a checkpoint written by
another run spec are each named, never loaded in silence (issue: manifest holes)."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoint_box import Box, load, save_steps

from aihpc.resilience import (
    MANIFEST,
    CheckpointCorruptError,
    CheckpointMismatchError,
    verify_checkpoint,
)
from aihpc.resilience.faults import corrupt_file


def step_dir(root, step):
    return root / f"step_{step:08d}"


def test_empty_manifest_verifies_nothing_so_it_is_corrupt(tmp_path):
    save_steps(tmp_path, [1, 2])
    manifest = step_dir(tmp_path, 2) / MANIFEST
    data = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**data, "files": {}}))
    corrupt_file(next(step_dir(tmp_path, 2).glob("*.distcp")))  # would load silently before
    with pytest.raises(CheckpointCorruptError, match="lists no files"):
        verify_checkpoint(step_dir(tmp_path, 2))
    step, box, problems = load(tmp_path)
    assert step == 1 and box.n == 1 and torch.equal(box.t, Box(1).t)
    assert any("lists no files" in p for p in problems)


def test_a_file_the_manifest_does_not_list_is_named(tmp_path):
    save_steps(tmp_path, [1, 2])
    stray = step_dir(tmp_path, 2) / "__9_0.distcp"
    stray.write_bytes(b"not part of the save")
    with pytest.raises(CheckpointCorruptError, match=r"__9_0\.distcp: not listed"):
        verify_checkpoint(step_dir(tmp_path, 2))
    assert load(tmp_path)[0] == 1


def test_a_listed_file_that_is_missing_is_named(tmp_path):
    save_steps(tmp_path, [1, 2])
    shard = next(step_dir(tmp_path, 2).glob("*.distcp"))
    shard.unlink()
    step, _, problems = load(tmp_path)
    assert step == 1 and any(f"{shard.name}: missing" in p for p in problems)


def test_deleted_manifest_is_named_not_silently_skipped(tmp_path, caplog):
    save_steps(tmp_path, [1, 2])
    (step_dir(tmp_path, 2) / MANIFEST).unlink()
    step, _, problems = load(tmp_path)
    assert step == 1
    named = [p for p in problems if "step_00000002" in p and "no MANIFEST.json" in p]
    assert named and named[0] in caplog.text
    # with no intact checkpoint left, the run refuses to start over in silence
    (step_dir(tmp_path, 1) / MANIFEST).unlink()
    with pytest.raises(CheckpointCorruptError, match=r"no MANIFEST\.json"):
        load(tmp_path)


@pytest.mark.parametrize("pointer", ["garbage\n", "step_00000009"])
def test_latest_is_read_and_checked(tmp_path, pointer):
    save_steps(tmp_path, [1, 2])
    (tmp_path / "LATEST").write_text(pointer)
    step, _, problems = load(tmp_path)
    assert step == 2  # the scan decides; the bad pointer is named, not followed
    assert any("LATEST" in p for p in problems)


def test_latest_naming_a_lost_checkpoint_is_named(tmp_path):
    save_steps(tmp_path, [1, 2])
    corrupt_file(next(step_dir(tmp_path, 2).glob("*.distcp")), "truncate")
    step, _, problems = load(tmp_path)
    assert step == 1 and any("truncated" in p for p in problems)


def test_checkpoint_of_another_run_is_refused_naming_the_fields(tmp_path):
    ident = {"model.num_layers": 2, "training.seed": 1, "data": "x"}
    save_steps(tmp_path, [1], identity=ident)
    assert json.loads((step_dir(tmp_path, 1) / MANIFEST).read_text())["run"] == ident
    assert load(tmp_path, identity=ident)[0] == 1
    other = {**ident, "model.num_layers": 4, "training.seed": 7}
    with pytest.raises(CheckpointMismatchError) as err:
        load(tmp_path, identity=other)
    text = str(err.value)
    assert "model.num_layers 2 → 4" in text and "training.seed 1 → 7" in text
    assert "data" not in err.value.differences[0] + err.value.differences[1]
