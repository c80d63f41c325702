"""A small Stateful and the save / load round of one process, shared by the manifest tests
(test_manifest_holes.py, test_manifest_damage.py)."""

from __future__ import annotations

import torch

from aihpc.resilience import CheckpointManager


class Box:
    """A tensor and a counter, both from ``seed``."""

    def __init__(self, seed: int = 0):
        self.t = torch.randn(16, 8, generator=torch.Generator().manual_seed(seed))
        self.n = seed

    def state_dict(self):
        return {"t": self.t, "n": self.n}

    def load_state_dict(self, sd):
        self.t.copy_(sd["t"])
        self.n = sd["n"]


def save_steps(root, steps, identity=None):
    """Synchronous saves of ``Box(step)`` at each step."""
    with CheckpointManager(root, async_save=False, identity=identity) as mgr:
        for s in steps:
            mgr.save(s, {"box": Box(s)})


def load(root, identity=None):
    """(step loaded, the Box it filled, the manager's problems)."""
    box = Box(99)
    with CheckpointManager(root, identity=identity) as mgr:
        step = mgr.load_latest({"box": box})
        problems = mgr.problems
    return step, box, problems
