"""The PyTorch runtime: a Llama-style decoder, any plan of the planner (DDP / FSDP2 / HSDP, tensor
+ sequence parallel, pipeline schedules, context parallel), resumable data, the trainer.

Imports torch; never imported by aihpc.spec or aihpc.perf.
"""

from aihpc.runtime.checks import check_plan, check_trainable
from aihpc.runtime.data import ByteTokenizer, TokenLoader, load_tokens
from aihpc.runtime.distributed import DistContext, init_distributed, launcher_env
from aihpc.runtime.launch import launch_elastic
from aihpc.runtime.mesh import Parallel, ParallelDims
from aihpc.runtime.model import Llama, LlamaConfig
from aihpc.runtime.parallelize import ModelParts, build_parallel_model
from aihpc.runtime.train import TrainOptions, run, train

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
