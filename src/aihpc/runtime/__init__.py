"""The PyTorch runtime: a Llama-style decoder, DDP / FSDP2, resumable data, the trainer.

Imports torch; never imported by aihpc.spec or aihpc.perf.
"""

from aihpc.runtime.data import ByteTokenizer, TokenLoader, load_tokens
from aihpc.runtime.distributed import DistContext, init_distributed, launcher_env
from aihpc.runtime.launch import launch_elastic
from aihpc.runtime.model import Llama, LlamaConfig
from aihpc.runtime.parallelize import build_parallel_model
from aihpc.runtime.train import TrainOptions, check_trainable, run, train

__all__ = [
    "ByteTokenizer",
    "DistContext",
    "Llama",
    "LlamaConfig",
    "TokenLoader",
    "TrainOptions",
    "build_parallel_model",
    "check_trainable",
    "init_distributed",
    "launch_elastic",
    "launcher_env",
    "load_tokens",
    "run",
    "train",
]
