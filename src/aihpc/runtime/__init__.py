"""The PyTorch runtime: a Llama-style decoder, any plan of the planner (DDP / FSDP2 / HSDP, tensor
+ sequence parallel, pipeline schedules, context parallel), resumable data, the trainer.

Imports torch; never imported by aihpc.runspec or aihpc.perf. Names load on first use (PEP 562): the
launcher checks a spec and starts its agent without the model, DTensor and pipeline code its
workers import.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "ByteTokenizer": "data",
    "DistContext": "distributed",
    "Llama": "model",
    "LlamaConfig": "config",
    "ModelParts": "parallelize",
    "Parallel": "mesh",
    "ParallelDims": "mesh",
    "TokenLoader": "data",
    "TrainOptions": "job",
    "build_parallel_model": "parallelize",
    "check_plan": "checks",
    "check_trainable": "checks",
    "init_distributed": "distributed",
    "launch_elastic": "launch",
    "launcher_env": "distributed",
    "load_tokens": "data",
    "run": "train",
    "train": "train",
}

__all__ = [
    "ByteTokenizer",
    "DistContext",
    "Llama",
    "LlamaConfig",
    "ModelParts",
    "Parallel",
    "ParallelDims",
    "TokenLoader",
    "TrainOptions",
    "build_parallel_model",
    "check_plan",
    "check_trainable",
    "init_distributed",
    "launch_elastic",
    "launcher_env",
    "load_tokens",
    "run",
    "train",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'aihpc.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(f"aihpc.runtime.{_WHERE[name]}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)
