"""Resilience for any PyTorch training loop: checkpoints that survive crashes, a hang watchdog,
fault injection. Imports torch; never imported by aihpc.spec or aihpc.perf.
"""

from aihpc.resilience.checkpoint import (
    MANIFEST,
    CheckpointCorruptError,
    CheckpointInfo,
    CheckpointManager,
    ModelOptimizerState,
    RNGState,
    state_sha256,
    verify_checkpoint,
)
from aihpc.resilience.faults import KINDS, Fault, FaultInjector, InjectedFault, parse_fault
from aihpc.resilience.watchdog import HANG_EXIT_CODE, Watchdog

__all__ = [
    "HANG_EXIT_CODE",
    "KINDS",
    "MANIFEST",
    "CheckpointCorruptError",
    "CheckpointInfo",
    "CheckpointManager",
    "Fault",
    "FaultInjector",
    "InjectedFault",
    "ModelOptimizerState",
    "RNGState",
    "Watchdog",
    "parse_fault",
    "state_sha256",
    "verify_checkpoint",
]
