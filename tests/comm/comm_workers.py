"""Spawned workers for the dispatch / combine tests: real processes, gloo, no mocks.

Every rank can regenerate every rank's inputs from the seed, so each rank computes the
single-process reference for the whole EP group itself and compares its own share.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from aihpc.bench.dist import init_distributed
from aihpc.comm import MoEDispatcher, build_ep_groups
from sync_count import host_syncs

HIDDEN = 5


def case_inputs(
    seed: int, rank: int, world: int, experts: int, k: int, dtype: torch.dtype, skew: bool = False
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tokens: integer-valued x (so sums are exact), distinct top-k experts per
    token with some slots dropped (-1), integer weights. Rank 1 has no tokens when seed is odd."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    n = 0 if (seed % 2 and rank == 1) else 4 + 3 * rank
    x = torch.randint(-7, 8, (n, HIDDEN), generator=g).to(dtype)
    scores = torch.rand((n, experts), generator=g)
    if skew:  # every token wants expert 0 (one rank, one expert gets everything)
        scores[:, 0] += 2
    idx = scores.topk(k, dim=1).indices
    idx[torch.rand((n, k), generator=g) < 0.15] = -1
    w = torch.randint(1, 4, (n, k), generator=g).to(dtype)
    c = torch.randn((n, HIDDEN), generator=g, dtype=torch.float64).to(dtype)
    return {"x": x, "idx": idx, "w": w, "c": c}


def expert_mats(seed: int, experts: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 77)
    return torch.randn((experts, HIDDEN, HIDDEN), generator=g, dtype=torch.float64).to(dtype) / 2


def expected_dispatch(inputs: list[dict], rank: int, per_rank: int) -> tuple[torch.Tensor, ...]:
    """Rows for ``rank``'s experts, expert-major, then source rank, then token: the contract."""
    xs, ws, counts = [], [], []
    for le in range(per_rank):
        e, num = rank * per_rank + le, 0
        for inp in inputs:
            for t in range(inp["idx"].shape[0]):
                hits = (inp["idx"][t] == e).nonzero().flatten().tolist()
                for j in hits:
                    xs.append(inp["x"][t])
                    ws.append(inp["w"][t, j])
                    num += 1
        counts.append(num)
    x = torch.stack(xs) if xs else torch.empty((0, HIDDEN), dtype=inputs[0]["x"].dtype)
    w = torch.stack(ws) if ws else torch.empty((0,), dtype=inputs[0]["w"].dtype)
    return x, w, torch.tensor(counts)


def _ep_forward(disp, inp, mats, per_rank, rank):
    """EP path: dispatch, expert_e(z) = tanh(z @ A_e) on the local experts, weighted combine."""
    x = inp["x"].clone().requires_grad_(True)
    w = inp["w"].clone().requires_grad_(True)
    local = mats[rank * per_rank : (rank + 1) * per_rank].clone().requires_grad_(True)
    d = disp.dispatch(x, inp["idx"], w)
    ys = [z @ local[e] for e, z in enumerate(d.x.split(d.tokens_per_expert))]
    y = torch.tanh(torch.cat(ys)) if ys else d.x
    out = disp.combine(y, d.handle, d.weights)
    (out * inp["c"]).sum().backward()
    return out.detach(), x.grad, w.grad, local.grad, d


def _reference(inputs, mats, rank, per_rank):
    """Single process: every rank's tokens, every expert, the formula written out."""
    xs = [i["x"].clone().requires_grad_(True) for i in inputs]
    ws = [i["w"].clone().requires_grad_(True) for i in inputs]
    a = mats.clone().requires_grad_(True)
    total, outs = 0.0, []
    for inp, x, w in zip(inputs, xs, ws, strict=True):
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j, e in enumerate(inp["idx"][t].tolist()):
                if e >= 0:
                    out[t] = out[t] + w[t, j] * torch.tanh(x[t] @ a[e])
        outs.append(out)
        total = total + (out * inp["c"]).sum()
    total.backward()
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    return outs[rank].detach(), xs[rank].grad, ws[rank].grad, a.grad[lo:hi]


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def _check_case(disp, seed, rank, world, experts, k, skew=False) -> dict[str, Any]:
    per_rank = experts // world
    f64 = torch.float64
    inputs = [case_inputs(seed, r, world, experts, k, f64, skew) for r in range(world)]
    inp = inputs[rank]
    # 1. dispatch delivers exactly the contracted rows, weights and counts (bitwise)
    d = disp.dispatch(inp["x"], inp["idx"], inp["w"])
    ex, ew, ecounts = expected_dispatch(inputs, rank, per_rank)
    res: dict[str, Any] = {
        "rows_equal": torch.equal(d.x, ex),
        "weights_equal": torch.equal(d.weights, ew),
        "counts_equal": d.tokens_per_expert == ecounts.tolist(),
        "x": d.x,
    }
    # 2. exact round trip: identity experts, unweighted and weighted (integers: exact sums)
    valid = (inp["idx"] >= 0).to(f64)
    res["roundtrip_unweighted"] = torch.equal(
        disp.combine(d.x, d.handle), inp["x"] * valid.sum(1, keepdim=True)
    )
    wsum = (inp["w"] * valid).sum(1, keepdim=True)
    res["roundtrip_weighted"] = torch.equal(disp.combine(d.x, d.handle, d.weights), inp["x"] * wsum)
    # without weights (DeepEP's combine without top-k weights): the same rows, none carried
    d0 = disp.dispatch(inp["x"], inp["idx"])
    res["unweighted_dispatch"] = (
        d0.weights is None
        and torch.equal(d0.x, d.x)
        and torch.equal(disp.combine(d0.x, d0.handle), inp["x"] * valid.sum(1, keepdim=True))
    )
    # 3. outputs and gradients against the single-process reference, float64
    mats = expert_mats(seed, experts, f64)
    with host_syncs() as syncs:  # what a GPU would wait for in one EP forward and backward
        got = _ep_forward(disp, inp, mats, per_rank, rank)
    res["syncs"], res["checked_ids"] = dict(syncs), inp["idx"].numel() > 0
    ref = _reference(inputs, mats, rank, per_rank)
    res["max_err"] = max(_max_err(g, r) for g, r in zip(got[:4], ref, strict=True))
    res["out"], res["grads"] = got[0], got[1:4]
    res["recv_rows"], res["inter_node_rows"] = got[4].recv_rows, got[4].inter_node_rows
    # the rows this rank should receive: one per (token, rank) pair, DeepEP's recv_x
    res["expected_recv_rows"] = sum(
        int(((i["idx"] >= 0) & (i["idx"] // per_rank == rank)).any(1).sum()) for i in inputs
    )
    res["expected_inter_node_rows"] = _distinct_owners(inp["idx"], per_rank * disp.rpn)
    res["expected_flat_send_rows"] = _distinct_owners(inp["idx"], per_rank)
    return res


def _distinct_owners(idx: torch.Tensor, experts_per_owner: int) -> int:
    """(token, owner) pairs: how many rows a token-once-per-owner exchange sends."""
    owners = [{e // experts_per_owner for e in row if e >= 0} for row in idx.tolist()]
    return sum(len(o) for o in owners)


def dispatch_checks(seeds: list[int], ranks_per_node: int | None) -> list[dict[str, Any]]:
    """Run every case on every rank, flat and (if ranks_per_node) hierarchical; rank 0 returns
    all ranks' results."""
    with init_distributed(60.0) as ctx:
        world, rank = ctx.world_size, ctx.rank
        experts, k = 4 * world, 3
        flat = MoEDispatcher(experts, build_ep_groups(world))
        hier = None
        if ranks_per_node:
            hier = MoEDispatcher(experts, build_ep_groups(world, ranks_per_node))
        out: dict[str, Any] = {}
        for seed in seeds:
            out[f"flat{seed}"] = _check_case(flat, seed, rank, world, experts, k)
            if hier is not None:
                out[f"hier{seed}"] = _check_case(hier, seed, rank, world, experts, k)
        out["skew"] = _check_case(flat, 3, rank, world, experts, k, skew=True)
        if hier is not None:
            out["hier_skew"] = _check_case(hier, 3, rank, world, experts, k, skew=True)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, out)
        return gathered


def bf16_combine_order(seed: int) -> dict[str, Any]:
    """A weighted bf16 combine on the flat path against its documented sum order, computed
    here by hand: per destination rank, the float32 sum of its experts' weighted outputs in
    ascending expert order, rounded to bf16 (the rank's partial); then the float32 sum of the
    partials in ascending rank order, rounded to bf16. Also counts the elements where a sum in
    float32 throughout (no rounding of the partials) would differ."""
    experts, k, n, hidden = 8, 4, 64, 16
    with init_distributed(60.0) as ctx:
        rank, world = ctx.rank, ctx.world_size
        per_rank = experts // world
        g = torch.Generator().manual_seed(seed * 100 + rank)
        x = torch.randn((n, hidden), generator=g).to(torch.bfloat16)
        idx = torch.rand((n, experts), generator=g).topk(k, dim=1).indices
        w = torch.rand((n, k), generator=g)  # a float32 router's gate weights
        scale = (torch.arange(experts, dtype=torch.float32) / 3 + 0.7).to(torch.bfloat16)
        disp = MoEDispatcher(experts, build_ep_groups(world))
        d = disp.dispatch(x, idx, w)
        local = torch.repeat_interleave(
            torch.arange(per_rank), torch.tensor(d.tokens_per_expert, dtype=torch.long)
        )
        y = d.x * scale[rank * per_rank + local].unsqueeze(1)  # the "experts": bf16 outputs
        got = disp.combine(y, d.handle, d.weights)
        want = torch.empty_like(got)
        fp32_only = torch.empty_like(got)
        for t in range(n):
            partials, exact = [], torch.zeros(hidden)
            for r in range(world):
                acc = torch.zeros(hidden)
                for e in sorted(int(v) for v in idx[t] if int(v) // per_rank == r):
                    j = int((idx[t] == e).nonzero())
                    term = (x[t] * scale[e]).float() * w[t, j]
                    acc = acc + term
                    exact = exact + term
                if any(int(v) // per_rank == r for v in idx[t]):
                    partials.append(acc.to(torch.bfloat16))
            total = torch.zeros(hidden)
            for p in partials:
                total = total + p.float()
            want[t], fp32_only[t] = total.to(torch.bfloat16), exact.to(torch.bfloat16)
        mine = {
            "dtype": str(got.dtype),
            "mismatch": int((got.view(torch.int16) != want.view(torch.int16)).sum()),
            "differs_from_fp32_sum": int((want != fp32_only).sum()),
        }
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine)
        return every  # every rank's (launch_local returns rank 0's)
