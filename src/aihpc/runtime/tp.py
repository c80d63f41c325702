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
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from aihpc.runtime.moe import MoE

__all__ = ["apply_tp"]


def _block_plan(sp: bool, moe: bool = False) -> dict[str, Any]:
    """One decoder layer's plan. Attention and the MLP take their input whole (Replicate):
    with sequence parallel it arrives as a sequence shard and is all-gathered first. An MoE
    feed-forward (sequence parallel is required with it) takes its sequence shard as it is,
    as a plain tensor (``_moe_local``)."""
    seq = Shard(1) if sp else Replicate()
    plan: dict[str, Any] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
    }
    if moe:
        plan["feed_forward"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
    else:
        plan |= {
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
        }
        if not moe:
            plan["feed_forward"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
    return plan


def _moe_local(moe: MoE, tp_mesh: Any, experts_elsewhere: bool) -> None:
    """An MoE feed-forward under tensor parallel with expert TP 1 (Megatron-Core's default in
    its MoE recipes): each TP rank routes the tokens of its own sequence shard through the
    whole block (router, experts, shared experts), as a data-parallel rank would, so its
    weights are replicated over TP (DTensors, as every other weight here) and their gradients
    summed over the TP group in the backward (``MoE.set_grad_group``). ``experts_elsewhere``:
    expert parallel shards the experts over its own mesh (``apply_ep``, next)."""
    for module in moe.modules():
        if experts_elsewhere and module is moe.experts:
            continue
        for name, p in list(module.named_parameters(recurse=False)):
            local = DTensor.from_local(p.detach(), tp_mesh, [Replicate()], run_check=False)
            setattr(module, name, nn.Parameter(local, requires_grad=p.requires_grad))
    moe.set_grad_group(tp_mesh.get_group())


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


def _moe_split(moe: MoE, tp_mesh: Any) -> None:
    """An MoE feed-forward with expert TP = tp: every expert's FFN (and the shared experts')
    split over the TP ranks as the dense MLP is (w1, w3 by columns of the FFN width, w2 by its
    rows), the router replicated; the block runs on the whole sequence (``moe._etp_block``).
    The router's gradient comes from each rank's partial outputs, so it is summed over TP."""
    experts = moe.experts
    for name, dim in (("w1", 2), ("w3", 2), ("w2", 1)):
        full = getattr(experts, name)
        split = distribute_tensor(full.detach(), tp_mesh, [Shard(dim)], src_data_rank=None)
        setattr(experts, name, nn.Parameter(split, requires_grad=full.requires_grad))
    if moe.shared is not None:
        shared = moe.shared
        for name, dim in (("w1", 0), ("w3", 0), ("w2", 1)):
            linear = getattr(shared, name)
            split = distribute_tensor(
                linear.weight.detach(), tp_mesh, [Shard(dim)], src_data_rank=None
            )
            linear.weight = nn.Parameter(split, requires_grad=linear.weight.requires_grad)
    gate = moe.router.gate
    whole = DTensor.from_local(gate.weight.detach(), tp_mesh, [Replicate()], run_check=False)
    gate.weight = nn.Parameter(whole, requires_grad=gate.weight.requires_grad)
    moe.router.grad_group = tp_mesh.get_group()
    moe.etp_mesh = tp_mesh


def apply_tp(
    model: nn.Module,
    tp_mesh: Any,
    sequence_parallel: bool,
    experts_elsewhere: bool = False,
    etp: int = 1,
) -> None:
    """Shard ``model`` (a Llama, possibly without the parts other pipeline stages hold) over
    ``tp_mesh`` in place. The output stays a vocabulary-sharded DTensor for loss parallel.
    ``experts_elsewhere``: expert parallel shards the MoE blocks' experts (``_moe_local``);
    ``etp``: 1, each TP rank runs whole experts on its tokens (``_moe_local``), or tp, every
    expert split over the TP ranks (``_moe_split``)."""
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
        moe = isinstance(block.feed_forward, MoE)
        parallelize_module(block, tp_mesh, _block_plan(sequence_parallel, moe))
        if moe and etp > 1:
            _moe_split(block.feed_forward, tp_mesh)
        elif moe:
            _moe_local(block.feed_forward, tp_mesh, experts_elsewhere)
        if not sequence_parallel:
            _replicate(block.attention_norm, tp_mesh)
            _replicate(block.ffn_norm, tp_mesh)
    if model.norm is not None and not sequence_parallel:
        _replicate(model.norm, tp_mesh)
