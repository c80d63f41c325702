"""Tensor parallel (+ sequence parallel, + loss parallel) over DTensor, as Megatron lays it out.

Megatron-LM (Shoeybi et al. 2019, §3; Korthikanti et al. 2022, §4.2 for sequence parallel):
in each layer the first matmul of attention (wq, wk, wv) and of the MLP (w1, w3) is split by
columns and the second (wo, w2) by rows, so each layer needs one all-reduce in the forward and
one in the backward per block. With sequence parallel the all-reduce becomes a reduce-scatter
to a sequence shard, the norms run on that shard, and an all-gather brings the full sequence
back before the next column-parallel matmul. The embedding is split by vocabulary rows and the
output by vocabulary columns, and the loss is computed on vocabulary shards (loss parallel), so
the full (tokens x vocab) logits never exist on one rank.

Heads are split with the columns: each rank holds num_heads / tp query heads and
num_kv_heads / tp key/value heads (tp must divide num_kv_heads).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = ["apply_tp"]


def _block_plan(sp: bool) -> dict[str, Any]:
    """One decoder layer's plan. Attention and the MLP take their input whole (Replicate):
    with sequence parallel it arrives as a sequence shard and is all-gathered first."""
    seq = Shard(1) if sp else Replicate()
    plan: dict[str, Any] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq),
    }
    if sp:
        plan |= {
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            # Attention.forward(x, cos, sin, layout): only x is distributed.
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None, None),
                desired_input_layouts=(Replicate(), None, None, None),
            ),
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
        }
    return plan


def _replicate(module: nn.Module, tp_mesh: Any) -> None:
    """Without sequence parallel the norms run on the whole (replicated) sequence on every TP
    rank: their weights become replicated DTensors too, so that every parameter of the model is
    a DTensor on the TP mesh (the optimizer's and the clipping's foreach kernels take one kind)."""

    def to_dtensor(_mod: nn.Module, inputs: tuple[Any, ...], mesh: Any) -> tuple[Any, ...]:
        return tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    def to_local(_mod: nn.Module, out: Any, _mesh: Any) -> Any:
        return out.to_local() if isinstance(out, DTensor) else out

    distribute_module(module, tp_mesh, input_fn=to_dtensor, output_fn=to_local)


def apply_tp(model: nn.Module, tp_mesh: Any, sequence_parallel: bool) -> None:
    """Shard ``model`` (a Llama, possibly without the parts other pipeline stages hold) over
    ``tp_mesh`` in place. The output stays a vocabulary-sharded DTensor for loss parallel."""
    seq = Shard(1) if sequence_parallel else Replicate()
    root: dict[str, Any] = {}
    if model.tok_embeddings is not None:
        root["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.output is not None:
        root["output"] = ColwiseParallel(
            input_layouts=seq, output_layouts=Shard(-1), use_local_output=False
        )
        if sequence_parallel:
            root["norm"] = SequenceParallel()
    if root:
        parallelize_module(model, tp_mesh, root)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, _block_plan(sequence_parallel))
        if not sequence_parallel:
            _replicate(block.attention_norm, tp_mesh)
            _replicate(block.ffn_norm, tp_mesh)
    if model.norm is not None and not sequence_parallel:
        _replicate(model.norm, tp_mesh)
