"""Resilience for any PyTorch training loop: checkpoints that survive crashes, a hang watchdog,
fault injection. Never imported by aihpc.runspec or aihpc.perf.

Only the checkpoint manager needs torch; it is imported when first used, so the launcher can
parse ``--inject``, hold the run directory and check manifests before paying for torch.
"""

from typing import Any

from aihpc.resilience.faults import KINDS, Fault, FaultInjector, InjectedFault, parse_fault
from aihpc.resilience.lock import RunDirBusyError, RunDirLock
from aihpc.resilience.manifest import (
    MANIFEST,
    CheckpointCorruptError,
    CheckpointInfo,
    CheckpointMismatchError,
    verify_checkpoint,
)
from aihpc.resilience.watchdog import HANG_EXIT_CODE, ORPHAN_EXIT_CODE, Watchdog, die_with_parent

_TORCH_NAMES = ("CheckpointManager", "ModelOptimizerState", "RNGState", "state_sha256")


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        from aihpc.resilience import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "HANG_EXIT_CODE",
    "KINDS",
    "MANIFEST",
    "ORPHAN_EXIT_CODE",
    "CheckpointCorruptError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointMismatchError",
    "Fault",
    "FaultInjector",
    "InjectedFault",
    "ModelOptimizerState",
    "RNGState",
    "RunDirBusyError",
    "RunDirLock",
    "Watchdog",
    "die_with_parent",
    "parse_fault",
    "state_sha256",
    "verify_checkpoint",
]
