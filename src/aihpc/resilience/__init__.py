"""Resilience for any PyTorch training loop: checkpoints that survive crashes, a hang watchdog,
fault injection. Imports torch; never imported by aihpc.spec or aihpc.perf.
"""

from aihpc.resilience.checkpoint import (
    MANIFEST,
    CheckpointCorruptError,
    CheckpointInfo,
    CheckpointManager,
    CheckpointMismatchError,
    ModelOptimizerState,
    RNGState,
    state_sha256,
    verify_checkpoint,
)
from aihpc.resilience.faults import KINDS, Fault, FaultInjector, InjectedFault, parse_fault
from aihpc.resilience.lock import RunDirBusyError, RunDirLock
from aihpc.resilience.watchdog import HANG_EXIT_CODE, ORPHAN_EXIT_CODE, Watchdog, die_with_parent

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
