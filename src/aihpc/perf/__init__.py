"""The analytical performance model: FLOPs, memory, step time, MFU, search, validation.

Pure Python (no torch): a user can plan a 16,384-GPU job on a laptop.
"""

from aihpc.perf.estimate import Estimate, estimate, estimate_plan
from aihpc.perf.memory import MemoryBreakdown, checkpoint_bytes, memory_breakdown
from aihpc.perf.params import DEFAULT_PARAMS, ModelParams
from aihpc.perf.search import SearchResult, search

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
