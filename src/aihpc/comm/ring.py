"""Context-parallel causal attention as a ring over the CP group (our own, torch only).

Each of the ``cp`` ranks holds ``s_local = seq / cp`` tokens of every sequence: its queries and
its block of keys / values. The K/V blocks travel around the ring (rank r sends to r + 1 and
receives from r - 1, the P2P pattern of Liu et al. 2023, "Ring Attention with Blockwise
Transformers", arXiv:2310.01889), and every rank merges its queries' attention over each block
with the online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022, Alg. 1),
keeping the running log-sum-exp, so the result equals full causal attention at this rank's
positions up to fp32 rounding.

Causality is decided by global positions, not by block order: a query at position i sees the
keys at positions j <= i. The positions travel with the K/V blocks, so any layout works; the
trainer uses :func:`load_balanced_positions` (rank r holds half-chunks r and 2cp - 1 - r, as
Megatron-LM's context parallelism does) so that every rank does the same causal work.

The backward is FlashAttention's (Dao 2023, FlashAttention-2, Alg. 2): with P = exp(S - lse)
and D = rowsum(dO * O), dV = P^T dO, dS = P * (dO V^T - D), dQ = dS K / sqrt(d),
dK = dS^T Q / sqrt(d). The K/V blocks go around the ring again, and a dK/dV accumulator travels
with each block, collecting every rank's contribution; one extra hop brings it home, so each
rank ends with the whole gradient of its own K/V block.

GQA: query head h uses kv head h // (heads / kv_heads), as SDPA's ``enable_gqa``. The queries of
one kv head are laid out as one (group * s_local) row block, so every product is one batched
matmul against the un-expanded K/V and the dK/dV sums over the head group come for free.

Scores are materialised per block in fp32 (batch x heads x s_local^2 per step): simple and exact,
not a fused kernel.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from aihpc.spec.errors import SpecError

__all__ = ["load_balanced_positions", "ring_attention"]

# gloo matches messages between two ranks by tag; NCCL ignores tags (it orders by issue).
_TAG_KV, _TAG_POS, _TAG_GRAD = 0, 1, 2


def load_balanced_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions (1-D int64, ascending) of the tokens CP rank ``rank`` of ``cp`` holds:
    the sequence in 2cp equal half-chunks, rank r takes chunks r and 2cp - 1 - r, so under a
    causal mask every rank does the same work (Megatron-LM's context-parallel layout)."""
    if cp < 1:
        raise SpecError("cp", cp, "the context-parallel degree must be at least 1")
    if not 0 <= rank < cp:
        raise SpecError("cp_rank", rank, f"must lie in [0, {cp}) for cp = {cp}")
    if cp == 1:
        return torch.arange(seq_len, dtype=torch.int64)
    if seq_len % (2 * cp):
        raise SpecError(
            "seq_len",
            seq_len,
            f"must be a multiple of 2 * cp = {2 * cp} (context parallel splits the sequence "
            f"into 2cp equal chunks); choose a seq_len divisible by {2 * cp} or a smaller cp",
        )
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, dtype=torch.int64)
    last_start = (2 * cp - 1 - rank) * chunk
    return torch.cat([first, torch.arange(last_start, last_start + chunk, dtype=torch.int64)])


class _Ring:
    """The CP group's ring: this rank's neighbours as global ranks, and one exchange step."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        me = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (me + 1) % self.size)
        self.prev = dist.get_global_rank(group, (me - 1) % self.size)

    def shift(self, tensor: torch.Tensor, tag: int) -> tuple[torch.Tensor, list[Any]]:
        """Start sending ``tensor`` to the next rank and receiving the previous rank's into a
        new buffer; returns (buffer, works): wait on the works before reading the buffer or
        changing ``tensor``."""
        recv = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ]
        return recv, dist.batch_isend_irecv(ops)


def _wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


def _masked_scores(
    q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """q: (b, kvh, g * s, d) with row gi * s + i for query i of head group member gi;
    k: (b, kvh, sk, d). Scores (b, kvh, g * s, sk), -inf where the key lies after the query."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    allowed = q_pos[:, None] >= k_pos[None, :]  # (s, sk)
    allowed = allowed.repeat(q.shape[2] // len(q_pos), 1)  # (g * s, sk)
    return s.masked_fill(~allowed, float("-inf"))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """A row that has seen no key yet has lse = -inf; 0 in its place keeps exp() from making
    NaN (exp(-inf - 0) = 0) while its probabilities stay 0."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _group_rows(x: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """(b, heads, s, d) -> (b, kv_heads, g * s, d) in ``dtype``: the query heads sharing a kv
    head stacked along the rows."""
    b, h, s, d = x.shape
    return x.to(dtype).reshape(b, kv_heads, (h // kv_heads) * s, d)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, positions, group):
        b, h, s, d = q.shape
        kvh = k.shape[1]
        cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        scale = 1.0 / math.sqrt(d)
        ring = _Ring(group)
        q_pos = positions.to(device=q.device, dtype=torch.int64)
        qg = _group_rows(q, kvh, cdt)
        kv = torch.stack([k, v]).contiguous()  # (2, b, kvh, s, d): one message per hop
        pos = q_pos.contiguous()
        out = torch.zeros_like(qg)  # normalised by the running lse
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=cdt, device=q.device)
        seen = []
        for step in range(ring.size):
            last = step == ring.size - 1
            if not last:  # the next block travels while this one is computed
                kv_next, kv_works = ring.shift(kv, _TAG_KV)
                pos_next, pos_works = ring.shift(pos, _TAG_POS)
            seen.append(pos)
            sc = _masked_scores(qg, kv[0].to(cdt), q_pos, pos, scale)
            new = torch.logaddexp(lse, torch.logsumexp(sc, dim=-1))
            safe = _finite(new)
            p = torch.exp(sc - safe[..., None])  # probabilities under the merged normaliser
            out = out * torch.exp(lse - safe)[..., None] + torch.matmul(p, kv[1].to(cdt))
            lse = new
            if not last:
                _wait(kv_works + pos_works)
                kv, pos = kv_next, pos_next
        out = out.reshape(b, h, s, d).to(q.dtype)
        ctx.group = group
        ctx.save_for_backward(q, k, v, out, lse, q_pos, torch.stack(seen))
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, q_pos, seen = ctx.saved_tensors
        b, h, s, d = q.shape
        kvh = k.shape[1]
        cdt = lse.dtype
        scale = 1.0 / math.sqrt(d)
        ring = _Ring(ctx.group)
        qg, dog = _group_rows(q, kvh, cdt), _group_rows(dout, kvh, cdt)
        delta = (dog * _group_rows(out, kvh, cdt)).sum(-1, keepdim=True)  # D = rowsum(dO * O)
        lse_safe = _finite(lse)[..., None]
        dq = torch.zeros_like(qg)
        kv = torch.stack([k, v]).contiguous()
        acc_in, grad_works = None, []
        for step in range(ring.size):
            last = step == ring.size - 1
            if not last:
                kv_next, kv_works = ring.shift(kv, _TAG_KV)
            kb, vb = kv[0].to(cdt), kv[1].to(cdt)
            p = torch.exp(_masked_scores(qg, kb, q_pos, seen[step], scale) - lse_safe)
            ds = p * (torch.matmul(dog, vb.transpose(-1, -2)) - delta)
            dq += torch.matmul(ds, kb) * scale
            # this rank's share of the held block's dK, dV (summed over the head group)
            mine = torch.stack([torch.matmul(ds.transpose(-1, -2), qg) * scale,
                                torch.matmul(p.transpose(-1, -2), dog)])  # fmt: skip
            if step == 0:
                acc = mine
            else:  # the accumulator of this block, holding the earlier ranks' shares
                _wait(grad_works)
                acc = acc_in + mine
            if ring.size > 1:  # pass it on; after the last step this hop brings it home
                acc_in, grad_works = ring.shift(acc, _TAG_GRAD)
            if not last:
                _wait(kv_works)
                kv = kv_next
        _wait(grad_works)
        dkv = acc_in if ring.size > 1 else acc
        dq = dq.reshape(b, h, s, d).to(q.dtype)
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: Any, positions: torch.Tensor
) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence, K/V passed around
    ``group`` (a ProcessGroup, any subgroup of the world).

    q: (batch, heads, s_local, head_dim); k, v: (batch, kv_heads, s_local, head_dim) with heads a
    multiple of kv_heads; positions: (s_local,) the global positions of this rank's tokens
    (every rank of the group holds the same s_local). Returns (batch, heads, s_local, head_dim),
    full causal softmax(q k^T / sqrt(head_dim)) v at these positions, computed in fp32 (fp64 for
    fp64 inputs) and returned in q's dtype. Differentiable in q, k, v; safe to recompute under
    torch.utils.checkpoint (no state outside the call)."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"ring_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}: expected 4-D (batch, heads, seq, head_dim), "
                         "k and v alike")  # fmt: skip
    b, h, s, d = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, s, d) or h % k.shape[1]:
        raise ValueError(
            f"ring_attention: k/v {tuple(k.shape)} do not fit q {tuple(q.shape)}: batch, seq and "
            "head_dim must match and heads must be a multiple of kv_heads"
        )
    if positions.shape != (s,):
        raise ValueError(
            f"ring_attention: positions {tuple(positions.shape)}: expected ({s},), one global "
            "position per local token"
        )
    return _RingAttention.apply(q, k, v, positions, group)
