"""A run record is data, validated on read (issue 42): a run killed at step 5 (checkpoints at 2
and 4) has one of its records damaged, as the drills found them, and is resumed. Each damaged
form is named on one line, repaired or skipped, its bytes kept; the resume ends bit for bit as
the uninterrupted run did (state_sha256, final loss, every logged loss that survived), and loss
history that no record holds any more is said lost, in the log and in summary.json."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
from train_cli import losses, ok
from train_cli import train as run_train
from typer.testing import CliRunner

from aihpc.cli import app
from aihpc.resilience import verify_checkpoint

pytestmark = pytest.mark.slow

SPEC = """
[model]
preset = "tiny-llama"
seq_length = 32
[cluster]
gpu = "h100-sxm"
num_gpus = 1
gpus_per_node = 1
[parallel]
zero_stage = 0
micro_batch_size = 1
global_batch_size = 2
[training]
train_steps = 6
learning_rate = 3e-3
warmup_steps = 1
seed = {seed}
[checkpoint]
interval_steps = 2
keep_last = 3
async_save = false
"""


def write_spec(path: Path, seed: int = 3) -> Path:
    path.write_text(SPEC.format(seed=seed))
    return path


def train(spec: Path, run: Path, *extra: str):
    return run_train(spec, run, *extra, timeout=240, env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """The uninterrupted run: its summary, its losses, its run directory."""
    d = tmp_path_factory.mktemp("ref")
    summary = ok(train(write_spec(d / "run.toml"), d / "run"))
    assert summary["final_step"] == 6 and summary["loss_history_lost"] == []
    return summary, losses(d / "run"), d / "run"


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """The same run SIGKILLed after step 5: checkpoints 2 and 4, metrics of steps 1-5."""
    d = tmp_path_factory.mktemp("killed")
    proc = train(write_spec(d / "run.toml"), d / "run", "--inject", "kill:step=5")
    assert proc.returncode == -signal.SIGKILL
    assert (d / "run" / "checkpoints" / "LATEST").read_text() == "step_00000004"
    return d / "run"


def edit_line(path: Path, index: int, old: bytes, new: bytes) -> bytes:
    """Replace ``old`` by ``new`` in line ``index`` (0-based) of ``path``; the damaged line."""
    lines = path.read_bytes().split(b"\n")
    assert old in lines[index]
    lines[index] = lines[index].replace(old, new)
    path.write_bytes(b"\n".join(lines))
    return lines[index]


def manifest_entry_not_a_table(run: Path) -> None:
    path = run / "checkpoints" / "step_00000004" / "MANIFEST.json"
    manifest = json.loads(path.read_text())
    manifest["files"]["__0_0.distcp"] = 5
    path.write_text(json.dumps(manifest))


def latest_a_folder(run: Path) -> None:
    (run / "checkpoints" / "LATEST").unlink()
    (run / "checkpoints" / "LATEST" / "inside").mkdir(parents=True)


M, E = "metrics.jsonl", "events.jsonl"
CKPT = "checkpoints/step_00000004"
# (id, damage, the one line naming it, steps whose loss history is lost, a damaged record kept)
FORMS = [
    (
        "metrics-step-null",
        lambda r: edit_line(r / M, 1, b'"step": 2', b'"step": null'),
        "metrics.jsonl line 2: step = null, not an integer; line skipped (kept in "
        "metrics.jsonl.damaged)",
        [[2, 2]],
        M + ".damaged",
    ),
    (
        "metrics-step-string",
        lambda r: edit_line(r / M, 2, b'"step": 3', b'"step": "three"'),
        'metrics.jsonl line 3: step = "three", not an integer; line skipped',
        [[3, 3]],
        M + ".damaged",
    ),
    (
        "metrics-not-utf8",
        lambda r: edit_line(r / M, 2, b'"loss"', b'"lo\xffss"'),
        "metrics.jsonl line 3: not UTF-8 (byte 0xff at column 16); line skipped",
        [[3, 3]],
        M + ".damaged",
    ),
    (
        "metrics-emptied",
        lambda r: (r / M).write_bytes(b""),
        "metrics.jsonl was empty: the loss history of step(s) 1-4, before the resume from step "
        "4, is lost",
        [[1, 4]],
        None,
    ),
    (
        "metrics-deleted",
        lambda r: (r / M).unlink(),
        "metrics.jsonl is missing: the loss history of step(s) 1-4, before the resume from step "
        "4, is lost",
        [[1, 4]],
        None,
    ),
    (
        "metrics-a-folder",
        lambda r: ((r / M).unlink(), (r / M).mkdir()),
        "metrics.jsonl is not a file; moved to metrics.jsonl.damaged, and a new metrics.jsonl "
        "begun",
        [[1, 4]],
        M + ".damaged",
    ),
    (
        "events-event-null",
        lambda r: edit_line(r / E, 2, b'"event": "pg_ready"', b'"event": null'),
        "events.jsonl line 3: event = null, not an event name; line skipped (kept in "
        "events.jsonl.damaged)",
        [],
        E + ".damaged",
    ),
    (
        "events-not-utf8",
        lambda r: edit_line(r / E, 3, b'"loaded"', b'"lo\xffaded"'),
        "events.jsonl line 4: not UTF-8 (byte 0xff at column 14); line skipped",
        [],
        E + ".damaged",
    ),
    (
        "manifest-entry-not-a-table",
        manifest_entry_not_a_table,
        "checkpoint step 4 is corrupt: {run}/checkpoints/step_00000004/MANIFEST.json: "
        "files['__0_0.distcp'] = 5, not a table of sha256 and size; resuming from step 2, the "
        "folder kept as corrupt/step_00000004",
        [],
        "checkpoints/corrupt/step_00000004/MANIFEST.json",
    ),
    (
        "manifest-not-json",
        lambda r: (r / CKPT / "MANIFEST.json").write_bytes(b"{\xff garbage"),
        "checkpoint step 4 is corrupt: {run}/checkpoints/step_00000004/MANIFEST.json: "
        "unreadable manifest (",
        [],
        "checkpoints/corrupt/step_00000004/MANIFEST.json",
    ),
    (
        "latest-a-folder",
        latest_a_folder,
        "{run}/checkpoints/LATEST: a folder, not a file naming a checkpoint (moved to "
        "corrupt/LATEST); now names step_00000004",
        [],
        "checkpoints/corrupt/LATEST/inside",
    ),
    (
        "latest-names-a-missing-step",
        lambda r: (r / "checkpoints" / "LATEST").write_text("step_00000009"),
        "{run}/checkpoints/LATEST: names step_00000009, which is not a committed checkpoint; "
        "now names step_00000004",
        [],
        None,
    ),
    (
        "latest-not-a-step",
        lambda r: (r / "checkpoints" / "LATEST").write_bytes(b"\xfe\xff"),
        "{run}/checkpoints/LATEST: unreadable ('utf-8' codec can't decode byte 0xfe in position "
        "0: invalid start byte); now names step_00000004",
        [],
        None,
    ),
]


@pytest.mark.parametrize(
    ("damage", "line", "lost", "kept"), [f[1:] for f in FORMS], ids=[f[0] for f in FORMS]
)
def test_damaged_record_is_named_and_resume_is_bitwise(
    tmp_path, ref, killed, damage, line, lost, kept
):
    run = tmp_path / "run"
    shutil.copytree(killed, run)
    damaged = damage(run)
    proc = train(write_spec(tmp_path / "run.toml"), run)
    summary = ok(proc)
    assert "Traceback" not in proc.stderr
    line = line.format(run=run)
    named = [x for x in proc.stderr.splitlines() if line in x]
    assert len(named) == 1, proc.stderr[-3000:]  # named once, on one line
    # the resume ends as the uninterrupted run did, bit for bit
    assert summary["state_sha256"] == ref[0]["state_sha256"]
    assert summary["final_loss"] == ref[0]["final_loss"]
    gone = {s for a, b in lost for s in range(a, b + 1)}
    assert losses(run) == [x for x in ref[1] if x[0] not in gone]
    assert summary["loss_history_lost"] == lost
    # nothing deleted in silence: the damaged record is kept for a person to read
    if isinstance(damaged, bytes):
        assert damaged in (run / kept).read_bytes().split(b"\n")
    elif kept is not None:
        assert (run / kept).exists()
    # no corrupt checkpoint is left committed, and LATEST names the newest one
    ckpts = run / "checkpoints"
    assert (ckpts / "LATEST").read_text() == "step_00000006"
    for step in (2, 4, 6):
        verify_checkpoint(ckpts / f"step_{step:08d}")


def test_damaged_summary_of_a_finished_run_is_kept_aside_and_rebuilt(tmp_path, ref):
    """summary.json's final_step null stopped the rerun of a finished run with a TypeError."""
    run = tmp_path / "run"
    shutil.copytree(ref[2], run)
    path = run / "summary.json"
    summary = json.loads(path.read_text())
    path.write_text(json.dumps({**summary, "final_step": None}))
    before = path.read_bytes()
    proc = train(write_spec(tmp_path / "run.toml"), run)
    rebuilt = ok(proc)
    named = [x for x in proc.stderr.splitlines() if "summary.json: final_step = null" in x]
    assert len(named) == 1 and "kept as summary.json.damaged" in named[0]
    assert (run / "summary.json.damaged").read_bytes() == before
    assert rebuilt["final_step"] == 6 and rebuilt["resumed_from_step"] == 6
    assert rebuilt["state_sha256"] == ref[0]["state_sha256"]
    assert rebuilt["final_loss"] == ref[0]["final_loss"]
    assert losses(run) == ref[1] and rebuilt["loss_history_lost"] == []
    assert json.loads(path.read_text())["state_sha256"] == ref[0]["state_sha256"]


def test_final_loss_of_a_finished_run_is_rebuilt_from_its_checkpoint_event(tmp_path, ref):
    """metrics.jsonl deleted and summary.json unreadable, the rerun of a finished run trains
    nothing: its final loss comes from the step-6 checkpoint's event, the rest is said lost."""
    run = tmp_path / "run"
    shutil.copytree(ref[2], run)
    (run / "metrics.jsonl").unlink()
    (run / "summary.json").write_text("{")
    proc = train(write_spec(tmp_path / "run.toml"), run)
    rebuilt = ok(proc)
    assert "metrics.jsonl is missing: the loss history of step(s) 1-6" in proc.stderr
    assert rebuilt["final_loss"] == ref[0]["final_loss"] and rebuilt["final_step"] == 6
    assert rebuilt["state_sha256"] == ref[0]["state_sha256"]
    assert rebuilt["loss_history_lost"] == [[1, 6]]


def test_garbage_manifest_and_another_seed_exit_2_before_any_worker(tmp_path, killed):
    """The newest manifest is unreadable and the intact one behind it is another run's: the
    refusal names the seed (exit 2, one line) before any worker starts, and nothing is moved."""
    run = tmp_path / "run"
    shutil.copytree(killed, run)
    (run / CKPT / "MANIFEST.json").write_text("garbage")
    other = write_spec(tmp_path / "other.toml", seed=4)
    result = CliRunner().invoke(
        app, ["train", str(other), "--run-dir", str(run), "--nproc-per-node", "1"]
    )
    assert result.exit_code == 2 and "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "training.seed 3 → 4" in lines[0]
    assert (run / CKPT).is_dir() and not (run / "checkpoints" / "corrupt").exists()
    assert (run / "checkpoints" / "LATEST").read_text() == "step_00000004"
