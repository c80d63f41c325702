"""Token dropping (model.moe_capacity_factor): per sequence and expert, the highest-scored
copies up to the capacity are kept and the rest dropped, the same choice as a plain loop over
the sequences, and the block's output and gradients those of the kept copies alone. Parity with
one process under data, expert and pipeline parallel: tests/runtime/test_search_trains.py
(spec "moe-capacity")."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from aihpc.runtime.moe import MoE, MoEConfig, keep_within_capacity

E, K, SEQ, DIM = 4, 2, 16, 8


def naive_keep(idx: torch.Tensor, weights: torch.Tensor, cap: int) -> set[tuple[int, int]]:
    kept = set()
    for start in range(0, idx.shape[0], SEQ):
        for e in range(E):
            copies = [
                (-weights[t, j].item(), t, j)
                for t in range(start, start + SEQ)
                for j in range(K)
                if idx[t, j] == e
            ]
            kept |= {(t, j) for _, t, j in sorted(copies)[:cap]}
    return kept


def test_the_kept_copies_are_each_experts_best_per_sequence():
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(3 * SEQ, E, generator=gen)
    weights, idx = scores.topk(K, dim=-1)
    weights[5, 0] = weights[6, 0]  # a tie, settled by position
    idx[6, 0] = idx[5, 0]
    for cap in (1, 3, 8, SEQ * K):
        token, slot = keep_within_capacity(idx, weights, SEQ, cap, E)
        got = list(zip(token.tolist(), slot.tolist(), strict=True))
        assert got == sorted(got)  # token order
        assert set(got) == naive_keep(idx, weights, cap)


def test_the_block_computes_the_kept_copies_only():
    torch.manual_seed(0)
    cfg = MoEConfig(dim=DIM, num_experts=E, top_k=K, expert_ffn_dim=6, capacity_factor=0.5)
    moe = MoE(cfg).double()
    x = torch.randn(2, SEQ, DIM, dtype=torch.float64, requires_grad=True)
    out = moe(x)
    h = x.reshape(-1, DIM)
    idx, weights, _ = moe.router(h, SEQ)
    cap = math.ceil(0.5 * SEQ * K / E)
    kept = naive_keep(idx, weights, cap)
    assert len(kept) < idx.numel()  # some copies were dropped
    w1, w3, w2 = moe.experts.w1, moe.experts.w3, moe.experts.w2
    rows = []
    for t in range(h.shape[0]):
        row = torch.zeros(DIM, dtype=torch.float64)
        for j in range(K):
            if (t, j) in kept:
                e = idx[t, j]
                row = row + weights[t, j] * ((F.silu(h[t] @ w1[e]) * (h[t] @ w3[e])) @ w2[e])
        rows.append(row)
    ref = torch.stack(rows).view_as(out)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out.sum(), [x, w1, w2])
    ref_grads = torch.autograd.grad(ref.sum(), [x, w1, w2])
    for a, b in zip(grads, ref_grads, strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
