"""The trainer's speed features, each a run-spec field, applied by parallelize.py in torchtitan's
order: FP8 linears (``training.precision = "fp8"``) on the single-device model before any
parallelism, tensor parallel, activation checkpointing (inside each block's forward), then
``torch.compile`` of each block (``training.compile``), then FSDP2 with its mixed-precision
policy (``training.param_dtype``, ``training.grad_reduce_dtype``).

Why that order: FP8 conversion swaps ``nn.Linear`` for torchao's ``Float8Linear`` before tensor
parallel shards the weights (torchao's float8 supports DTensor weights); compile traces a block
whose checkpoint and DTensor weights are already in place, so what runs is what was compiled;
FSDP2 wraps the compiled block from outside, its gather and reduce hooks around the compiled
forward and backward (Dynamo leaves FSDP's hooks eager). ``nn.Module.compile`` compiles in
place, so the blocks keep their names and checkpoints do not change with ``compile``.

``check_speed`` refuses, before any worker starts, what this host cannot run: compile without a
C compiler (Inductor builds its kernels with one), FP8 without a CUDA GPU of compute capability
8.9 or newer and torchao.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from typing import Any

import torch
from torch import nn

from aihpc.runspec import SpecError, TrainingSpec

__all__ = [
    "apply_fp8",
    "check_speed",
    "compile_blocks",
    "ddp_comm_hook",
    "describe",
    "mp_policy",
    "param_dtype",
]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Compute capability that FP8 GEMMs (torch._scaled_mm) need: Ada and Hopper, and newer.
FP8_MIN_CAPABILITY = (8, 9)


def c_compiler() -> str | None:
    """The C compiler Inductor would use (CC, else cc / gcc / clang on PATH)."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def check_speed(t: TrainingSpec, cuda: bool | None = None) -> None:
    """Refuse, with one line naming the field, what this host cannot run (compile under tensor
    parallel is a plan rule: ``aihpc.runspec.rules.trainer_compile_refusal``). ``cuda``: whether
    the ranks will run on CUDA GPUs (default: whether this host has one)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if t.compile and c_compiler() is None:
        raise SpecError(
            "training.compile",
            True,
            "torch.compile's Inductor builds its kernels with a C compiler and none is on PATH "
            "(set CC or install gcc); allowed here: false",
        )
    if t.precision != "fp8":
        return
    if not cuda:
        raise SpecError(
            "training.precision",
            t.precision,
            "FP8 linears need CUDA GPUs (torchao float8); this host has none, and the CPU "
            "trainer computes in fp32; allowed here: bf16",
        )
    cap = torch.cuda.get_device_capability()
    if cap < FP8_MIN_CAPABILITY:
        raise SpecError(
            "training.precision",
            t.precision,
            f"FP8 GEMMs need compute capability >= 8.9 (Ada, Hopper); this GPU has "
            f"{cap[0]}.{cap[1]}; allowed here: bf16",
        )
    if importlib.util.find_spec("torchao") is None:
        raise SpecError(
            "training.precision",
            t.precision,
            "FP8 linears run through torchao's float8, which is not installed "
            "(pip install 'aihpc[fp8]'); allowed without it: bf16",
        )


def _fp8_eligible(module: nn.Module, fqn: str) -> bool:
    """FP8 for the decoder's linears, not the output layer (16-bit in torchtitan, Megatron and
    NeMo FP8 recipes), and only where both dimensions are multiples of 16 (_scaled_mm)."""
    if not isinstance(module, nn.Linear) or fqn.split(".")[-1] == "output":
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_fp8(model: nn.Module, gather_fp8: bool = False) -> int:
    """Swap the eligible linears for torchao's Float8Linear (tensorwise scaling); with
    ``gather_fp8`` FSDP2 gathers their weights in FP8 (training.fp8_param_gather). Returns how
    many were converted."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=gather_fp8)
    convert_to_float8_training(model, config=config, module_filter_fn=_fp8_eligible)
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())


def compile_blocks(model: nn.Module) -> None:
    """Compile each decoder block in place (Inductor). Not fullgraph: ring attention and the
    MoE router's host syncs break the graph, and the rest compiles around them."""
    for block in model.layers.values():
        block.compile(backend="inductor")


def param_dtype(t: TrainingSpec, device_type: str) -> torch.dtype:
    """The dtype FSDP2 gathers parameters in: ``param_dtype``, auto being bf16 on GPUs and fp32
    on CPUs."""
    name = t.param_dtype
    if name == "auto":
        name = "bf16" if device_type == "cuda" else "fp32"
    return _DTYPES[name]


def mp_policy(t: TrainingSpec, device_type: str) -> Any:
    """FSDP2's MixedPrecisionPolicy: parameters gathered (and computed with) in
    ``param_dtype``, gradients reduced in ``grad_reduce_dtype``; output not cast. None where
    both are fp32 (FSDP2's default: nothing cast)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    gather, reduce = param_dtype(t, device_type), _DTYPES[t.grad_reduce_dtype]
    if gather == torch.float32 and reduce == torch.float32:
        return None
    # inputs not cast: the RoPE tables stay fp32, as under autocast
    return MixedPrecisionPolicy(param_dtype=gather, reduce_dtype=reduce, cast_forward_inputs=False)


def ddp_comm_hook(t: TrainingSpec) -> Any:
    """DDP's gradient all-reduce in ``grad_reduce_dtype``: PyTorch's bf16 / fp16 compression
    hook (the gradients are cast for the all-reduce and back), None for fp32."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {
        "fp32": None,
        "bf16": default_hooks.bf16_compress_hook,
        "fp16": default_hooks.fp16_compress_hook,
    }[t.grad_reduce_dtype]


def describe(model: nn.Module, t: TrainingSpec, device_type: str) -> dict[str, Any]:
    """What the rank runs, for the run's events: compiled blocks, FP8 linears, FSDP2's dtypes."""
    blocks = list(model.layers.values()) if hasattr(model, "layers") else []
    return {
        "compiled_blocks": sum(getattr(b, "_compiled_call_impl", None) is not None for b in blocks),
        "fp8_linears": sum(type(m).__name__ == "Float8Linear" for m in model.modules()),
        "param_dtype": str(param_dtype(t, device_type)).removeprefix("torch."),
        "grad_reduce_dtype": t.grad_reduce_dtype,
    }
