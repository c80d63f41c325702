"""A mixture-of-experts feed-forward block for one device (expert parallelism is applied from
outside, by ``aihpc.runtime.expert_parallel.apply_ep``).

y = shared(x) + sum_{j < k} g_j(x) * expert_{e_j}(x), experts SwiGLU (Shazeer 2020), where the
router picks the top-k experts e_j of each token:

* scores ``softmax`` (Mixtral, Qwen3) or ``sigmoid`` (DeepSeek-V3, arXiv 2412.19437 eq. 15);
  gate weights are the selected scores, normalised over the k (``route_norm``; Mixtral's
  "softmax over the top-k logits" is the same thing) and scaled by ``route_scale``
  (DeepSeek-V3's routed_scaling_factor 2.5);
* group-limited routing (DeepSeek-V3 §2.1.2 / its config's n_group, topk_group): experts split in
  ``num_groups`` groups (EP nodes: node-limited routing), a token keeps its ``topk_groups`` best
  groups by the sum of each group's two best scores, then picks top-k inside them;
* load balancing without an auxiliary loss (DeepSeek-V3 §2.1.2, eq. 16; Wang et al. 2024,
  arXiv 2408.15664): a per-expert bias added to the scores for the *choice* only (gate weights
  use the raw scores); after each optimizer step ``update_expert_bias`` moves every bias by
  ``bias_update_rate`` towards balance: b_i += rate * sign(mean load - load_i), the loads counted
  over the whole global batch;
* and/or DeepSeek-V3's sequence-wise balance loss (eq. 17-20): alpha * sum_i f_i P_i per sequence,
  f_i = E / (k T) * #tokens choosing i, P_i = mean over the sequence of the normalised scores,
  averaged over the sequences. Per sequence, so data parallelism leaves it unchanged. Its
  gradient is attached to the block's output (Megatron-Core's MoEAuxLossAutoScaler), so the
  trainer's loss and its backward need no change; ``aux_loss_scale`` scales it (set it to
  1 / gradient-accumulation steps if the trainer divides its loss by them).

Expert compute is grouped: the tokens of one expert are contiguous, and the three SwiGLU matmuls
run per expert (a loop) or as ``torch.nn.functional.grouped_mm`` (one call; on CPU in torch 2.13
it is slower than the loop, so ``auto`` picks it on CUDA only). Tokens are grouped, and summed
back, by the ``aihpc.comm`` operators with no communication, so one code path serves one process
and expert parallelism, and the sums are in a fixed order (bitwise reproducible on GPU too).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from aihpc.comm import MoEDispatcher
from aihpc.runtime.config import EXPERT_COMPUTE, ROUTER_SCORES, MoEConfig, moe_config_from_spec

__all__ = [
    "EXPERT_COMPUTE",
    "ROUTER_SCORES",
    "GroupedExperts",
    "MoE",
    "MoEConfig",
    "Router",
    "loads_not_counted",
    "moe_config_from_spec",
    "update_expert_bias",
]


def _in_backward() -> bool:
    """True while autograd runs a backward (activation recompute re-runs forwards there)."""
    return torch._C._current_graph_task_id() != -1


class Router(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.dim, cfg.num_experts, bias=False)
        # aux-loss-free balancing bias: state (checkpointed), not a parameter
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts), persistent=True)
        # tokens per expert since the last bias update; a plain attribute, so DDP's buffer
        # broadcast cannot overwrite one rank's count with another's
        self.load: torch.Tensor | None = None
        # off inside ``loads_not_counted``: forwards that train nothing count nothing
        self.count_loads = True
        self.grad_group: Any = None  # tensor parallel with etp 1: gate gradient summed over it

    def _scores(self, h: torch.Tensor) -> torch.Tensor:
        # at least float32 whatever autocast says: the choice must not flip with rounding
        dtype = torch.promote_types(h.dtype, torch.float32)
        with torch.autocast(h.device.type, enabled=False):
            weight = local_weight(self.gate.weight, self.grad_group)
            logits = F.linear(h.to(dtype), weight.to(dtype))
        return logits.softmax(dim=-1) if self.cfg.score_func == "softmax" else logits.sigmoid()

    def _choose(self, scores: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        choice = scores.detach() + self.expert_bias
        if cfg.num_groups > 1:
            t, per_group = choice.shape[0], cfg.num_experts // cfg.num_groups
            grouped = choice.view(t, cfg.num_groups, per_group)
            group_score = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)
            keep = group_score.topk(cfg.topk_groups, dim=-1).indices
            allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(~allowed.repeat_interleave(per_group, dim=1), -torch.inf)
        return choice.topk(cfg.top_k, dim=-1).indices

    def _balance_loss(self, scores: torch.Tensor, idx: torch.Tensor, seq_len: int) -> torch.Tensor:
        """DeepSeek-V3 eq. 17-20, averaged over the sequences of the micro-batch."""
        cfg = self.cfg
        e, k = cfg.num_experts, cfg.top_k
        norm = scores if cfg.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
        p = norm.view(-1, seq_len, e).mean(dim=1)  # (sequences, E)
        chosen = idx.view(-1, seq_len * k)
        f = torch.zeros_like(p).scatter_add_(1, chosen, torch.ones_like(chosen, dtype=p.dtype))
        f = f * (e / (k * seq_len))
        return cfg.aux_loss_coeff * (f * p).sum(dim=-1).mean()

    def forward(
        self, h: torch.Tensor, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """h: (tokens, dim) → top-k expert ids (tokens, k), gate weights (tokens, k) in float32
        (float64 for a float64 model), the balance loss (None when off or not training)."""
        scores = self._scores(h)
        idx = self._choose(scores)
        weights = scores.gather(1, idx)
        if self.cfg.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.cfg.route_scale
        if self.training and self.count_loads and not _in_backward():
            # scatter_add, not bincount: bincount reads the largest id on the host (a sync)
            flat = idx.flatten()
            counts = torch.zeros(self.cfg.num_experts, dtype=torch.long, device=idx.device)
            counts = counts.scatter_add_(0, flat, torch.ones_like(flat)).float()
            self.load = counts if self.load is None else self.load + counts
        aux = None
        if self.cfg.aux_loss_coeff > 0 and self.training:
            aux = self._balance_loss(scores, idx, seq_len)
        return idx, weights, aux


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient (expert weights under EP)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return g * ctx.scale, None


class _SumGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group`` (Megatron's copy to the
    tensor-parallel region): a weight every rank of ``group`` holds whole, each applying it to
    its own tokens, gets the gradient of all of them."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        g = g.contiguous().clone()
        torch.distributed.all_reduce(g, group=ctx.group)
        return g, None


def local_weight(p: torch.Tensor, grad_group: Any = None) -> torch.Tensor:
    """This rank's tensor of parameter ``p`` (a DTensor's local part); with ``grad_group`` (the
    tensor-parallel ranks, each routing its own sequence shard through the MoE block), its
    gradient summed over that group."""
    w = p.to_local() if isinstance(p, DTensor) else p
    return _SumGrad.apply(w, grad_group) if grad_group is not None else w


class _AttachAux(torch.autograd.Function):
    """Returns y unchanged; in backward also feeds d(aux)/d(aux) = 1 into the balance loss."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(aux)
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        (aux,) = ctx.saved_tensors
        return g, torch.ones_like(aux)


class _SwiGLUDown(torch.autograd.Function):
    """(silu(h1) * h3) @ w2 keeping h1, h3 and w2 only: the activation's output is made again in
    the backward, from them (``recompute_modules = ["moe_act"]``, Megatron-Core's moe_act)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx: Any, h1: torch.Tensor, h3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(h1, h3, w2)
        return (F.silu(h1) * h3) @ w2

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        h1, h3, w2 = ctx.saved_tensors
        with torch.enable_grad():
            h1_, h3_ = h1.detach().requires_grad_(), h3.detach().requires_grad_()
            act = F.silu(h1_) * h3_
        grad_w2 = act.detach().t() @ g
        grad_h1, grad_h3 = torch.autograd.grad(act, (h1_, h3_), g @ w2.t())
        return grad_h1, grad_h3, grad_w2


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts as three stacked weights: w1, w3 (E, dim, ffn), w2 (E, ffn,
    dim). Under EP they are DTensors sharded on dim 0 over the EP mesh (this rank's experts)."""

    def __init__(self, num_experts: int, dim: int, ffn_dim: int, compute: str = "auto"):
        super().__init__()
        self.compute = compute
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.grad_scale = 1.0  # 1 / EP size under EP (see expert_parallel.py)
        self.recompute_act = False  # recompute_modules "moe_act": the SwiGLU output not kept
        self.grad_group: Any = None  # tensor parallel with etp 1 (see MoE.set_grad_group)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.w1.device.type != "meta":
            for w in (self.w1, self.w3, self.w2):
                nn.init.normal_(w, std=0.02)

    def _weights(self) -> list[torch.Tensor]:
        out = []
        for p in (self.w1, self.w3, self.w2):
            w = local_weight(p, self.grad_group)
            out.append(_ScaleGrad.apply(w, self.grad_scale) if self.grad_scale != 1.0 else w)
        return out

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """x: (m, dim), the tokens of local expert 0 first, then of expert 1, ... → (m, dim)."""
        w1, w3, w2 = self._weights()
        # torch's grouped_mm takes float32 / 16-bit rows of a multiple of 16 bytes; on CPU the
        # loop is faster (torch 2.13), so "auto" uses it on GPUs only
        aligned = all(n * x.element_size() % 16 == 0 for n in w1.shape[1:])
        grouped = self.compute == "grouped_mm" or (
            self.compute == "auto" and x.is_cuda and x.dtype != torch.float64 and aligned
        )
        if grouped:
            offs = torch.tensor(tokens_per_expert, device=x.device).cumsum(0).to(torch.int32)
            h1, h3 = F.grouped_mm(x, w1, offs=offs), F.grouped_mm(x, w3, offs=offs)
            if self.recompute_act:  # grouped: the down projection is run again with it
                return checkpoint(_grouped_down, h1, h3, w2, offs, use_reentrant=False)
            return _grouped_down(h1, h3, w2, offs)
        # unbind, not w1[e]: the backward of indexing one expert writes a zero gradient the
        # size of all experts' weights and adds it up, once per expert (E^2 traffic: 12 of
        # 19 ms of kernels at GPT-OSS-120B's 16 local experts on an H200,
        # benchmarks/moe_layer_eager.py); unbind's backward stacks the experts' gradients once
        outs = []
        weights = (w1.unbind(0), w3.unbind(0), w2.unbind(0))
        for xe, a, b, c in zip(x.split(tokens_per_expert), *weights, strict=True):
            if self.recompute_act:
                outs.append(_SwiGLUDown.apply(xe @ a, xe @ b, c))
            else:
                outs.append((F.silu(xe @ a) * (xe @ b)) @ c)
        return torch.cat(outs) if outs else x.new_zeros((0, w2.shape[-1]))


def _grouped_down(
    h1: torch.Tensor, h3: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    return F.grouped_mm(F.silu(h1) * h3, w2, offs=offs)


class SharedExperts(nn.Module):
    """The always-on experts, as one SwiGLU of width num_shared * expert_ffn (DeepSeekMoE)."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.grad_group: Any = None  # tensor parallel with etp 1 (see MoE.set_grad_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1, w3, w2 = (local_weight(m.weight, self.grad_group) for m in (self.w1, self.w3, self.w2))
        return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg)
        self.experts = GroupedExperts(
            cfg.num_experts, cfg.dim, cfg.expert_ffn_dim, cfg.expert_compute
        )
        self.shared = (
            SharedExperts(cfg.dim, cfg.num_shared_experts * cfg.expert_ffn_dim)
            if cfg.num_shared_experts
            else None
        )
        # one process holds every expert until apply_ep gives it an EP group
        self.dispatcher = MoEDispatcher(cfg.num_experts)
        self.aux_loss_scale = 1.0
        self.last_aux_loss: torch.Tensor | None = None
        self.etp_mesh: Any = None  # expert tensor parallel over the TP mesh (runtime/tp.py)

    def _dropping(
        self, h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, seq_len: int
    ) -> torch.Tensor:
        """The routed experts' output with token dropping: each expert takes at most
        ``capacity(seq_len)`` of each sequence's (token, expert) copies, the highest-scored
        first (Megatron-Core's "probs" drop policy; ties by position), the others dropped (no
        compute, no gradient). Counted per sequence, so what is dropped does not depend on the
        micro-batch, data or expert parallel; the kept copies go through the same dispatch and
        combine, one copy per row."""
        cap = self.capacity(seq_len)
        token, slot = keep_within_capacity(idx, weights, seq_len, cap, self.cfg.num_experts)
        kept_idx, kept_w = idx[token, slot].unsqueeze(1), weights[token, slot].unsqueeze(1)
        routed = self.dispatcher.dispatch(h[token], kept_idx, kept_w)
        y = self.experts(routed.x, routed.tokens_per_expert)
        part = self.dispatcher.combine(y, routed.handle, routed.weights)
        return part.new_zeros((h.shape[0], part.shape[1])).index_add(0, token, part)

    def capacity(self, seq_len: int) -> int:
        """Copies of one sequence an expert takes: ceil(factor x seq_len x top_k / experts)."""
        cfg = self.cfg
        assert cfg.capacity_factor is not None
        return math.ceil(cfg.capacity_factor * seq_len * cfg.top_k / cfg.num_experts)

    def set_grad_group(self, group: Any) -> None:
        """Tensor parallel with expert TP 1 (``runtime/tp.py``): each TP rank routes its own
        sequence shard through the whole block, so every weight's gradient is summed over the
        TP ``group`` in the backward."""
        for part in (self.router, self.experts, self.shared):
            if part is not None:
                part.grad_group = group

    def init_buffers(self) -> None:
        """Zero the router state (after ``to_empty``: buffers of a meta-built model are garbage)."""
        self.router.expert_bias.zero_()
        self.router.load = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, seq, dim) → (batch, seq, dim). Under expert TP (``etp_mesh``), x is this
        rank's sequence shard: the block runs on the whole sequence, each rank with its slice
        of every expert, and returns its shard of the sum (``_etp_block``)."""
        if self.etp_mesh is not None:
            return _etp_block(self, x, self.etp_mesh)
        return self._block(x)

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = x.reshape(b * s, d)
        idx, weights, aux = self.router(h, s)
        if self.cfg.capacity_factor is None:
            routed = self.dispatcher.dispatch(h, idx, weights)
            y = self.experts(routed.x, routed.tokens_per_expert)
            out = self.dispatcher.combine(y, routed.handle, routed.weights).to(x.dtype)
        else:
            out = self._dropping(h, idx, weights, s).to(x.dtype)
        if self.shared is not None:
            out = out + self.shared(h)
        if aux is not None:
            self.last_aux_loss = aux.detach()
            out = _AttachAux.apply(out, aux * self.aux_loss_scale)
        return out.view(b, s, d)


def keep_within_capacity(
    idx: torch.Tensor, weights: torch.Tensor, seq_len: int, capacity: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, slot) of the (token, expert) copies kept, in token order: per sequence of
    ``seq_len`` tokens and expert, the ``capacity`` highest gate weights (ties: the earlier
    token, then the earlier slot)."""
    t, k = idx.shape
    flat = torch.arange(t * k, device=idx.device)
    group = (flat // k // seq_len) * num_experts + idx.flatten()
    by_score = torch.sort(-weights.detach().flatten(), stable=True).indices
    order = by_score[torch.sort(group[by_score], stable=True).indices]
    grouped = group[order]
    starts = torch.ones_like(grouped, dtype=torch.bool)
    starts[1:] = grouped[1:] != grouped[:-1]
    first = torch.cummax(torch.where(starts, flat, 0), 0).values
    keep = torch.zeros(t * k, dtype=torch.bool, device=idx.device)
    keep[order] = (flat - first) < capacity
    kept = flat[keep]
    return kept // k, kept % k


def _etp_block(moe: MoE, x: torch.Tensor, mesh: Any) -> torch.Tensor:
    """Expert tensor parallel as Megatron-Core's all-gather token dispatcher runs it: the TP
    ranks' sequence shards all-gathered (backward: reduce-scattered, summing what each rank's
    slices gave back), the router run on the whole sequence by every rank alike, each rank's
    slice of every expert's FFN (and of the shared experts') applied, and the partial sums
    reduce-scattered to the sequence shards (backward: all-gathered)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    whole = DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(
        mesh, [Replicate()]
    )
    partial = moe._block(whole.to_local(grad_placements=[Partial()]))
    out = DTensor.from_local(partial, mesh, [Partial()], run_check=False)
    return out.redistribute(mesh, [Shard(1)]).to_local()


@contextmanager
def loads_not_counted(module: nn.Module) -> Iterator[None]:
    """The routers of ``module`` count no tokens inside: for forwards that are not part of the
    global batch (torch's pipeline metadata inference runs one on its own inputs, on every
    stage but the first from uninitialised memory), which must not move the routing bias."""
    routers = [m for m in module.modules() if isinstance(m, Router)]
    before = [r.count_loads for r in routers]
    for r in routers:
        r.count_loads = False
    try:
        yield
    finally:
        for r, flag in zip(routers, before, strict=True):
            r.count_loads = flag


@torch.no_grad()
def update_expert_bias(model: nn.Module, group: Any = None) -> None:
    """After an optimizer step: move each MoE layer's routing bias towards balance
    (DeepSeek-V3 §2.1.2) from the tokens per expert counted since the last call, summed over
    ``group`` (every rank whose tokens make up the global batch: data and expert parallel).
    One all-reduce for all layers. A no-op for layers with bias_update_rate 0."""
    routers = [m for m in model.modules() if isinstance(m, Router) and m.cfg.bias_update_rate > 0]
    if not routers:
        return
    loads = torch.stack(
        [r.load if r.load is not None else torch.zeros_like(r.expert_bias) for r in routers]
    )
    if torch.distributed.is_initialized():  # group None: the default (whole job) group
        torch.distributed.all_reduce(loads, group=group)
    for r, load in zip(routers, loads, strict=True):
        r.expert_bias += r.cfg.bias_update_rate * torch.sign(load.mean() - load)
        r.load = None
