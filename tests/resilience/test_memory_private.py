"""The in-memory checkpoint folder under /dev/shm is private: created 0700 by its owner, and a
folder a neighbour pre-created (a symbolic link to theirs, one open to all, one they own) is
never used, even when it holds a state that would load: the tier turns off with one warning
line and the run goes on with storage checkpoints. A real single-rank gloo process group."""

from __future__ import annotations

import logging
import os
import shutil
import stat

import pytest
import torch
import torch.distributed as dist

from aihpc.resilience.memory import MemoryCheckpoint, memory_key
from aihpc.resilience.private_dir import private_dir

IDENTITY = {"run": "private-test"}
NOBODY = 65534


class Box:
    """A state with one tensor: what the tier saves and restores."""

    def __init__(self, value: float) -> None:
        self.t = torch.full((8,), value)

    def state_dict(self) -> dict:
        return {"t": self.t}

    def load_state_dict(self, sd: dict) -> None:
        self.t = sd["t"]


@pytest.fixture(scope="module", autouse=True)
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _tier(run_dir, root) -> MemoryCheckpoint:
    return MemoryCheckpoint(run_dir, IDENTITY, max_bytes=2**30, root=root)


def _planted(tmp_path):
    """A run dir, and the file a neighbour feeds: a valid snapshot of a state of theirs (7.0)
    for this run's key, taken in a folder of its own."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    theirs = tmp_path / "theirs-root"
    tier = _tier(run_dir, theirs)
    assert tier.snapshot(4, {"box": Box(7.0)})
    tier.close()
    return run_dir, theirs / f"aihpc-{memory_key(run_dir)}" / "own-0.bin"


def _attack(kind: str, target, planted, tmp_path) -> None:
    """Pre-create the run's memory folder ``target`` as a neighbour would, the state inside."""
    if kind == "symlink":
        decoy = tmp_path / "decoy"
        decoy.mkdir(mode=0o700)
        shutil.copy(planted, decoy / "own-0.bin")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(decoy, target_is_directory=True)
        return
    target.mkdir(parents=True)
    shutil.copy(planted, target / "own-0.bin")
    if kind == "world-writable":
        target.chmod(0o777)
    else:  # another user's folder, closed to others as a careful neighbour would make it
        os.chown(target / "own-0.bin", NOBODY, NOBODY)
        os.chown(target, NOBODY, NOBODY)
        target.chmod(0o700)


@pytest.mark.parametrize("kind", ["symlink", "world-writable", "other-owner"])
def test_a_pre_created_folder_is_never_used(tmp_path, caplog, kind):
    if kind == "other-owner" and os.geteuid() != 0:
        pytest.skip("chown to another uid needs root (CI runs these tests as root)")
    run_dir, planted = _planted(tmp_path)
    root = tmp_path / "shm"
    target = root / f"aihpc-{memory_key(run_dir)}"
    _attack(kind, target, planted, tmp_path)
    before = planted.read_bytes()
    caplog.set_level(logging.WARNING, logger="aihpc.resilience")
    tier = _tier(run_dir, root)
    try:
        box = Box(1.0)
        assert tier.restore({"box": box}, None) is None  # storage serves, not their state
        assert torch.equal(box.t, torch.full((8,), 1.0))
        assert not tier.snapshot(6, {"box": box})  # nothing of ours goes into their folder
        assert sorted(p.name for p in target.iterdir()) == ["own-0.bin"]
        assert (target / "own-0.bin").read_bytes() == before
        assert tier.off and tier.report()["skipped"].startswith("in-memory tier off")
        tier.discard()  # and nothing of theirs is removed
        assert (target / "own-0.bin").exists()
    finally:
        tier.close()
    lines = [
        r.getMessage() for r in caplog.records if "in-memory checkpoints off" in r.getMessage()
    ]
    assert len(lines) == 1 and str(target) in lines[0] and "\n" not in lines[0]


def test_the_folder_it_makes_is_private_and_used(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    root = tmp_path / "shm"
    tier = _tier(run_dir, root)
    try:
        st = os.lstat(tier.dir)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
        assert st.st_uid == os.getuid()
        assert tier.snapshot(2, {"box": Box(3.0)})
        box = Box(0.0)
        assert tier.restore({"box": box}, None) == {"step": 2, "from_peer": []}
        assert torch.equal(box.t, torch.full((8,), 3.0))
    finally:
        tier.close()


def test_private_dir_closes_a_folder_of_ours_others_could_only_read(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    mine.chmod(0o755)
    assert private_dir(mine) is None
    assert stat.S_IMODE(os.lstat(mine).st_mode) == 0o700
    (tmp_path / "file").write_text("x")
    assert private_dir(tmp_path / "file") == "is not a folder"


def test_private_dir_refuses_a_parent_others_may_swap_it_in(tmp_path):
    """Without the sticky bit, anyone who can write the parent can rename our folder away."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert "no sticky bit" in private_dir(shared / "aihpc-x")
    shared.chmod(0o1777)  # as /dev/shm
    assert private_dir(shared / "aihpc-x") is None
