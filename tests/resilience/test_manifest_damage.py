"""A MANIFEST.json is data, checked before it is trusted (issue 42): each damaged form is named
(the field, its value, what is allowed) as the corrupt checkpoint it makes, the load falls back
to the newest intact one, and the corrupt one is un-committed by a move into ``corrupt/``, kept,
with LATEST naming the checkpoint loaded. A file entry that was not a table raised TypeError and
left the corrupt checkpoint committed, LATEST naming it."""

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


def edit(manifest: dict, change) -> dict:
    change(manifest)
    return manifest


def entry(m: dict) -> dict:
    return m["files"]["__0_0.distcp"]


# (id, the manifest's new text from the sound one, what the one line says)
FORMS = [
    ("an-array", lambda m: "[]", "a JSON list, not a table"),
    ("not-json", lambda m: "{garbage", "unreadable manifest (Expecting property name"),
    ("not-utf8", lambda m: b'{"files": "\xff"}', "unreadable manifest ('utf-8' codec"),
    ("too-deep", lambda m: "[" * 100_000 + "]" * 100_000, "unreadable manifest (maximum recursion"),
    ("files-a-list", lambda m: {**m, "files": [1, 2]}, "files = [1, 2], not a table of file name"),
    (
        "entry-an-int",
        lambda m: edit(m, lambda m: m["files"].update({"__0_0.distcp": 5})),
        "files['__0_0.distcp'] = 5, not a table of sha256 and size",
    ),
    (
        "sha256-null",
        lambda m: edit(m, lambda m: entry(m).update(sha256=None)),
        "files['__0_0.distcp'].sha256 = null, not 64 hex digits",
    ),
    (
        "size-a-string",
        lambda m: edit(m, lambda m: entry(m).update(size="812")),
        "files['__0_0.distcp'].size = \"812\", not a size in bytes",
    ),
    (
        "size-negative",
        lambda m: edit(m, lambda m: entry(m).update(size=-1)),
        "files['__0_0.distcp'].size = -1, not a size in bytes",
    ),
    (
        "name-outside-the-folder",
        lambda m: edit(m, lambda m: m["files"].update({"../x": entry(m)})),
        "files lists '../x', not a file of the checkpoint folder",
    ),
    ("step-another", lambda m: {**m, "step": 7}, "step = 7, but the folder is step_00000002"),
    ("run-not-a-table", lambda m: {**m, "run": 5}, "run = 5, not a table"),
]


@pytest.mark.parametrize(("damage", "says"), [f[1:] for f in FORMS], ids=[f[0] for f in FORMS])
def test_damaged_manifest_is_named_set_aside_and_loaded_past(tmp_path, damage, says):
    save_steps(tmp_path, [1, 2])
    folder, path = tmp_path / "step_00000002", tmp_path / "step_00000002" / MANIFEST
    new = damage(json.loads(path.read_text()))
    data = new if isinstance(new, bytes) else (json.dumps(new) if isinstance(new, dict) else new)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    with pytest.raises(CheckpointCorruptError) as err:
        verify_checkpoint(folder)
    assert str(err.value).startswith(f"{path}: ") and says in str(err.value)
    assert "\n" not in str(err.value)
    step, box, problems = load(tmp_path)
    assert step == 1 and box.n == 1 and torch.equal(box.t, Box(1).t)
    line = [p for p in problems if says in p]
    assert len(line) == 1 and line[0].startswith("checkpoint step 2 is corrupt: ")
    assert line[0].endswith("resuming from step 1, the folder kept as corrupt/step_00000002")
    # un-committed, not deleted: the bytes are where the line says; LATEST names what loaded
    assert not folder.exists()
    assert (tmp_path / "corrupt" / "step_00000002" / MANIFEST).read_bytes() == path_bytes(data)
    assert (tmp_path / "LATEST").read_text() == "step_00000001"
    assert load(tmp_path)[2] == []  # the next load meets nothing wrong


def path_bytes(data) -> bytes:
    return data if isinstance(data, bytes) else data.encode()


def test_nothing_is_moved_without_an_intact_checkpoint_or_for_another_run(tmp_path):
    """A fallback that finds nothing, or a checkpoint of another run, changes nothing on disk:
    the run refuses, and the corrupt checkpoint stays where the person will look."""
    save_steps(tmp_path / "a", [1])
    (tmp_path / "a" / "step_00000001" / MANIFEST).write_text("[]")
    with pytest.raises(CheckpointCorruptError, match="a JSON list, not a table"):
        load(tmp_path / "a")
    assert (tmp_path / "a" / "step_00000001").is_dir() and not (tmp_path / "a" / "corrupt").exists()

    ident = {"training.seed": 1}
    save_steps(tmp_path / "b", [1, 2], identity=ident)
    (tmp_path / "b" / "step_00000002" / MANIFEST).write_text("[]")
    with pytest.raises(CheckpointMismatchError, match=r"training\.seed 1 → 2"):
        load(tmp_path / "b", identity={"training.seed": 2})
    assert (tmp_path / "b" / "step_00000002").is_dir() and not (tmp_path / "b" / "corrupt").exists()
    assert (tmp_path / "b" / "LATEST").read_text() == "step_00000002"


def test_a_second_corrupt_copy_of_a_step_is_kept_beside_the_first(tmp_path):
    save_steps(tmp_path, [1, 2])
    (tmp_path / "step_00000002" / MANIFEST).write_text("[]")
    assert load(tmp_path)[0] == 1
    save_steps(tmp_path, [2])
    (tmp_path / "step_00000002" / MANIFEST).write_text("{}")
    step, _, problems = load(tmp_path)
    assert step == 1 and problems[-1].endswith("kept as corrupt/step_00000002.2")
    assert sorted(p.name for p in (tmp_path / "corrupt").iterdir()) == [
        "step_00000002",
        "step_00000002.2",
    ]


def test_latest_a_folder_does_not_stop_the_next_commit(tmp_path):
    """LATEST a folder raised IsADirectoryError at the first commit; it is moved aside."""
    (tmp_path / "LATEST" / "x").mkdir(parents=True)
    save_steps(tmp_path, [1])
    assert (tmp_path / "LATEST").read_text() == "step_00000001"
    assert (tmp_path / "corrupt" / "LATEST" / "x").is_dir()


def test_a_step_folder_that_is_no_checkpoint_is_kept_when_its_step_is_saved_again(tmp_path, caplog):
    """A step folder whose MANIFEST.json was deleted is skipped by the load; saving that step
    again replaced it with rmtree, without a word. It is kept, and the replacement named."""
    save_steps(tmp_path, [1, 2])
    shard = next((tmp_path / "step_00000002").glob("*.distcp"))
    data = shard.read_bytes()
    (tmp_path / "step_00000002" / MANIFEST).unlink()
    assert load(tmp_path)[0] == 1
    save_steps(tmp_path, [2])
    verify_checkpoint(tmp_path / "step_00000002")
    assert (tmp_path / "corrupt" / "step_00000002" / shard.name).read_bytes() == data
    assert f"{tmp_path / 'step_00000002'}: replaced by a new save of step 2; kept as" in caplog.text
