"""Spawned workers for the expert-parallel tests: real processes, gloo, no mocks.

Each rank trains its share of the global batch through the EP block and, in the same process,
trains the single-process reference block on the whole global batch, then compares: loss per
step, the block output, every gradient, and the parameters after the optimizer step.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from aihpc.bench.dist import init_distributed
from aihpc.comm import build_ep_groups
from aihpc.runtime.expert_parallel import allreduce_gradients, apply_ep, clip_grad_norm_
from aihpc.runtime.model import Llama, LlamaConfig
from aihpc.runtime.moe import MoE, MoEConfig, update_expert_bias

BLOCK = MoEConfig(
    dim=16,
    num_experts=8,
    top_k=3,
    expert_ffn_dim=12,
    num_shared_experts=1,
    score_func="sigmoid",
    route_scale=2.5,
    bias_update_rate=0.05,
    aux_loss_coeff=0.01,
    num_groups=4,
    topk_groups=2,
)
SEQ, SEQS_PER_RANK = 6, 2


def _data(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: (world * SEQS_PER_RANK, SEQ, dim) inputs and targets."""
    g = torch.Generator().manual_seed(100 + step)
    shape = (world * SEQS_PER_RANK, SEQ, BLOCK.dim)
    return torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(
        shape, generator=g, dtype=torch.float64
    )


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _max_diff(ep_model: torch.nn.Module, ref: torch.nn.Module, what: str) -> float:
    """Largest |EP - reference| over parameters (what="param") or gradients ("grad"); an EP
    shard is compared with its slice of the reference."""
    worst = 0.0
    ref_params = dict(ref.named_parameters())
    for name, p in ep_model.named_parameters():
        q = ref_params[name]
        a, b = (p, q) if what == "param" else (p.grad, q.grad)
        a_local = _local(a)
        if isinstance(p, DTensor):
            lo = p.device_mesh.get_local_rank() * a_local.shape[0]
            b = b[lo : lo + a_local.shape[0]]
        worst = max(worst, float((a_local - b).detach().abs().max()))
    return worst


def _forward_backward(model, x, target, edp_group, fault: str) -> tuple[torch.Tensor, ...]:
    out = model(x)
    loss = F.mse_loss(out, target)
    loss.backward()
    if fault != "no_grad_sync" and edp_group is not None:
        allreduce_gradients(model, None, edp_group)
    return out.detach(), loss.detach()


def _optimizer_step(model, opt) -> None:
    clip_grad_norm_(model, 0.05)  # small enough to clip: the EP norm must be the global one
    opt.step()
    opt.zero_grad()


def block_run(
    ep: int, ranks_per_node: int | None, steps: int, fault: str, alone: Any
) -> dict[str, Any]:
    """EP block vs single-process block for ``steps`` AdamW steps; returns per-step errors.
    ``alone``: a group of this rank only (the reference's bias update sums nothing)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = build_ep_groups(ep, ranks_per_node)
    torch.manual_seed(0)
    ref = MoE(BLOCK).double()
    model = apply_ep(copy.deepcopy(ref), groups)
    if fault == "no_weights":  # combine forgets the gate weights
        disp = model.dispatcher
        disp.combine = lambda y, handle, weights=None, _c=disp.combine: _c(y, handle, None)
    if fault == "no_grad_scale":
        model.experts.grad_scale = 1.0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    lo, hi = rank * SEQS_PER_RANK, (rank + 1) * SEQS_PER_RANK
    errs: dict[str, list[float]] = {"loss": [], "out": [], "grad": [], "param": [], "bias": []}
    for step in range(steps):
        x, target = _data(step, world)
        out, loss = _forward_backward(model, x[lo:hi], target[lo:hi], groups.expert_dp, fault)
        ref_out, ref_loss = _forward_backward(ref, x, target, None, "")
        dist.all_reduce(loss)
        errs["loss"].append(abs(float(loss) / world - float(ref_loss)))
        errs["out"].append(float((out - ref_out[lo:hi]).abs().max()))
        errs["grad"].append(_max_diff(model, ref, "grad"))
        _optimizer_step(model, opt)
        _optimizer_step(ref, ref_opt)
        update_expert_bias(model)
        update_expert_bias(ref, group=alone)
        errs["param"].append(_max_diff(model, ref, "param"))
        diff = model.router.expert_bias - ref.router.expert_bias
        errs["bias"].append(float(diff.abs().max()))
    errs["bias_moved"] = float(ref.router.expert_bias.abs().max())
    return errs


def ep_suite(
    runs: list[tuple[int, int | None, str]],
    steps: int,
    llama_steps: int = 0,
    pp_microbatches: int = 0,
) -> dict[str, Any]:
    """Every block run, then (``llama_steps`` > 0) the Llama run, then (``pp_microbatches`` > 0,
    2 ranks) the pipeline's router loads, in one process group."""
    with init_distributed(60.0) as ctx:
        singles = [dist.new_group([r]) for r in range(ctx.world_size)]
        alone = singles[ctx.rank]
        blocks = [block_run(ep, rpn, steps, fault, alone) for ep, rpn, fault in runs]
        llama = llama_run(llama_steps) if llama_steps else None
        pp = pp_router_loads(pp_microbatches) if pp_microbatches else None
        return {"blocks": blocks, "llama": llama, "pp_loads": pp}


TINY = LlamaConfig(
    dim=16,
    num_layers=3,
    num_heads=2,
    num_kv_heads=1,
    ffn_dim=32,
    vocab_size=64,
    max_seq_len=8,
    moe=MoEConfig(dim=16, num_experts=4, top_k=2, expert_ffn_dim=8, first_dense_layers=1),
)


def llama_run(steps: int) -> dict[str, Any]:
    """A Llama with MoE layers: EP over every rank, built on meta and initialised after
    apply_ep, against the same model in one process. Cross-entropy per step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = build_ep_groups(world)
    with torch.device("meta"):
        model = Llama(TINY)
    apply_ep(model, groups)
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    ref = Llama(TINY)
    ref.init_weights(seed=3)
    init_err = _max_diff(model, ref, "param")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(7)
    losses, ref_losses = [], []
    for _ in range(steps):
        tokens = torch.randint(0, TINY.vocab_size, (2 * world, 9), generator=g)
        mine = tokens[2 * rank : 2 * rank + 2]
        loss = F.cross_entropy(model(mine[:, :-1]).flatten(0, 1), mine[:, 1:].flatten())
        loss.backward()
        allreduce_gradients(model, None, groups.expert_dp)
        opt.step()
        opt.zero_grad()
        ref_loss = F.cross_entropy(ref(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        dist.all_reduce(loss)
        losses.append(float(loss.detach()) / world)
        ref_losses.append(float(ref_loss))
    return {
        "init_err": init_err,
        "losses": losses,
        "ref_losses": ref_losses,
        "param_err": _max_diff(model, ref, "param"),
        "expert_local_shape": tuple(_local(model.layers["1"].feed_forward.experts.w1).shape),
    }


PP_TINY = LlamaConfig(
    dim=16,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    ffn_dim=32,
    vocab_size=64,
    max_seq_len=8,
    moe=MoEConfig(dim=16, num_experts=4, top_k=2, expert_ffn_dim=8, bias_update_rate=0.01),
)


def pp_router_loads(microbatches: int) -> dict[str, Any]:
    """Two pipeline stages (one MoE layer each, 1F1B through the trainer's ``build_schedule``),
    one step: the tokens each stage's router counted, and what one process counts running the
    same micro-batches through the whole model. Every rank's result, gathered."""
    from aihpc.runtime.mesh import ParallelDims
    from aihpc.runtime.pp import StageModule, build_schedule
    from aihpc.runtime.step import token_loss

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(
        0, PP_TINY.vocab_size, (microbatches, PP_TINY.max_seq_len + 1), generator=g
    )
    x, y = tokens[:, :-1], tokens[:, 1:]
    ref = Llama(PP_TINY)
    ref.init_weights(seed=5)
    for xm in x.split(1):
        ref(xm)
    model = Llama(PP_TINY)
    del model.layers[str(1 - rank)]
    if rank:
        model.tok_embeddings = None
    else:
        model.norm = model.output = None
    model.init_weights(seed=5)
    stage = StageModule(model, [rank], rank == 0, rank == 1)
    dims = ParallelDims(pp=2)
    schedule = build_schedule(
        [stage], [rank], dims, dist.group.WORLD, torch.device("cpu"), microbatches, token_loss
    )
    schedule.step(*((x,) if rank == 0 else ()), target=y if rank else None, losses=[])
    got = model.layers[str(rank)].feed_forward.router.load
    want = ref.layers[str(rank)].feed_forward.router.load
    mine = {"stage": rank, "got": got.tolist(), "want": want.tolist()}
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out
