"""The analytical performance model: FLOPs, memory, step time, MFU, search, validation.

Pure Python (no torch): a user can plan a 16,384-GPU job on a laptop.
"""

from aihpc.perf.search.ranking import SearchResult, search
from aihpc.perf.step.batch_memory import memory_breakdown
from aihpc.perf.step.estimate import Estimate, estimate, estimate_plan
from aihpc.perf.step.memory import MemoryBreakdown, checkpoint_bytes
from aihpc.perf.step.params import DEFAULT_PARAMS, ModelParams

__all__ = [
    "DEFAULT_PARAMS",
    "Estimate",
    "MemoryBreakdown",
    "ModelParams",
    "SearchResult",
    "checkpoint_bytes",
    "estimate",
    "estimate_plan",
    "memory_breakdown",
    "search",
]
