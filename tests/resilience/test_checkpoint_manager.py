"""CheckpointManager in one process: commit, checksums, fallback, retention, kill mid-write."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from aihpc.resilience import (
    MANIFEST,
    CheckpointCorruptError,
    CheckpointManager,
    RNGState,
    state_sha256,
    verify_checkpoint,
)
from aihpc.resilience.faults import corrupt_file


class Box:
    """A minimal Stateful: a tensor and a counter."""

    def __init__(self, seed: int = 0):
        self.t = torch.randn(64, 32, generator=torch.Generator().manual_seed(seed))
        self.n = seed

    def state_dict(self):
        return {"t": self.t, "n": self.n}

    def load_state_dict(self, sd):
        self.t.copy_(sd["t"])
        self.n = sd["n"]


def save_steps(root, steps, **kw):
    with CheckpointManager(root, **kw) as mgr:
        for s in steps:
            mgr.save(s, {"box": Box(s), "rng": RNGState()})
    return mgr


@pytest.mark.parametrize("async_save", [False, True])
def test_commit_writes_manifest_last_and_pointer(tmp_path, async_save):
    save_steps(tmp_path, [1, 2], async_save=async_save)
    assert (tmp_path / "LATEST").read_text() == "step_00000002"
    ckpt = tmp_path / "step_00000002"
    manifest = json.loads((ckpt / MANIFEST).read_text())
    on_disk = {f.name for f in ckpt.iterdir()} - {MANIFEST}
    assert set(manifest["files"]) == on_disk and ".metadata" in on_disk
    verify_checkpoint(ckpt)
    box = Box(99)
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.load_latest({"box": box, "rng": RNGState()}) == 2
    assert box.n == 2 and torch.equal(box.t, Box(2).t)


@pytest.mark.parametrize("mode", ["flip", "truncate"])
def test_corrupt_shard_names_file_and_falls_back(tmp_path, mode, caplog):
    save_steps(tmp_path, [1, 2], async_save=False)
    shard = next((tmp_path / "step_00000002").glob("*.distcp"))
    corrupt_file(shard, mode)
    with pytest.raises(CheckpointCorruptError, match=shard.name):
        verify_checkpoint(shard.parent)
    box = Box(99)
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.load_latest({"box": box, "rng": RNGState()}) == 1
    assert box.n == 1 and torch.equal(box.t, Box(1).t)
    assert str(shard) in caplog.text  # the log names the corrupt file


def test_all_corrupt_is_a_loud_error(tmp_path):
    save_steps(tmp_path, [1], async_save=False)
    shard = next((tmp_path / "step_00000001").glob("*.distcp"))
    corrupt_file(shard)
    with (
        CheckpointManager(tmp_path) as mgr,
        pytest.raises(CheckpointCorruptError, match=shard.name),
    ):
        mgr.load_latest({"box": Box()})


def test_no_checkpoint_returns_none(tmp_path):
    with CheckpointManager(tmp_path / "empty") as mgr:
        assert mgr.load_latest({"box": Box()}) is None


def test_retention_keeps_last_k_and_newest_intact(tmp_path):
    save_steps(tmp_path, [1, 2, 3, 4], keep_last=2, async_save=True)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000003", "step_00000004"]
    # Newest intact is step 2 after a fallback; a later save with keep_last=1 must keep it.
    root = tmp_path / "r2"
    save_steps(root, [1, 2], keep_last=5, async_save=False)
    corrupt_file(next((root / "step_00000002").glob("*.distcp")))
    with CheckpointManager(root, keep_last=1, async_save=False) as mgr:
        assert mgr.load_latest({"box": Box()}) == 1
        mgr.save(3, {"box": Box(3)})
        names = sorted(p.name for p in root.glob("step_*"))
    assert "step_00000003" in names
    with CheckpointManager(root, keep_last=1, async_save=False) as mgr:
        mgr.save(4, {"box": Box(4)})
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000004"]


def test_bare_module_or_optimizer_is_refused(tmp_path):
    model = torch.nn.Linear(2, 2)
    with CheckpointManager(tmp_path) as mgr, pytest.raises(TypeError, match="ModelOptimizerState"):
        mgr.save(1, {"model": model})


def test_state_sha256_covers_every_leaf():
    a, b = Box(1), Box(1)
    assert state_sha256({"b": a}) == state_sha256({"b": b})
    b.n = 2
    assert state_sha256({"b": a}) != state_sha256({"b": b})
    b.n = 1
    b.t[3, 4] += 1e-6
    assert state_sha256({"b": a}) != state_sha256({"b": b})


KILLER = textwrap.dedent("""
    import os, signal, sys, torch
    from aihpc.resilience import CheckpointManager
    class Big:
        def __init__(self, s): self.t = torch.full((1 << 20, 8), float(s))  # 32 MiB
        def state_dict(self): return {"t": self.t}
        def load_state_dict(self, sd): self.t.copy_(sd["t"])
    root, mode = sys.argv[1], sys.argv[2]
    hook = (lambda step: os.kill(os.getpid(), signal.SIGKILL) if step == 2 else None)
    with CheckpointManager(root, async_save=(mode == "async"),
                           before_commit=hook if mode == "hook" else None) as m:
        for step in range(1, 1000):
            m.save(step, {"big": Big(step)})
            print(step, flush=True)
""")


@pytest.mark.parametrize("mode", ["hook", "async"])
def test_sigkill_during_write_keeps_previous_checkpoint(tmp_path, mode):
    """SIGKILL a real writer mid-checkpoint; the previous commit stays latest, the partial
    one is ignored by load and removed by the next manager."""
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    root = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(root), mode], stdout=subprocess.PIPE, text=True
    )
    if mode == "async":
        # Kill as soon as a later save is in flight: while step >= 2 is being written.
        for line in proc.stdout:
            if int(line) >= 2 and list(root.glob("*.partial")):
                proc.send_signal(signal.SIGKILL)
                break
    proc.wait(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    partial = list(root.glob("*.partial"))
    committed = sorted(p.name for p in root.glob("step_????????"))
    assert partial and not (partial[0] / MANIFEST).exists()
    latest = (root / "LATEST").read_text()
    assert latest == committed[-1]
    step = int(latest.split("_")[1])
    assert partial[0].name == f"step_{step + 1:08d}.partial"

    class Big:
        t = torch.zeros(1 << 20, 8)

        def state_dict(self):
            return {"t": self.t}

        def load_state_dict(self, sd):
            self.t.copy_(sd["t"])

    big = Big()
    with CheckpointManager(root) as mgr:
        assert not list(root.glob("*.partial"))
        assert mgr.load_latest({"big": big}) == step
    assert torch.equal(big.t, torch.full((1 << 20, 8), float(step)))
