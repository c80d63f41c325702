"""Context-parallel causal attention as a ring over the CP group (our own, torch only).

Each of the ``cp`` ranks holds ``s_local = seq / cp`` tokens of every sequence: its queries and
its block of keys / values. The K/V blocks travel around the ring (rank r sends to r + 1 and
receives from r - 1, the P2P pattern of Liu et al. 2023, "Ring Attention with Blockwise
Transformers", arXiv:2310.01889), and every rank merges its queries' attention over each block
with the online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022, Alg. 1),
keeping the running log-sum-exp, so the result equals full causal attention at this rank's
positions up to fp32 rounding.

Causality is decided by global positions, not by block order: a query at position i sees the
keys at positions j <= i. Every rank is given the whole layout, a (cp, s_local) table of every
CP rank's positions, so the block that arrives from rank c is masked with row c without its
positions travelling with it; any layout works, and the trainer uses
:func:`load_balanced_layout` (rank r holds half-chunks r and 2cp - 1 - r, as Megatron-LM's
context parallelism does) so that every rank does the same causal work.

Messages per layer, for cp > 1: the forward sends cp - 1 (one K/V block per hop). The backward
sends cp, as Transformer Engine's p2p ring (``AttnFuncWithCPAndKVP2P.backward`` in
transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py, TE d0067d0):
it starts from the block the forward held last (rank r + 1's) and turns the ring round (rank r
sends to r - 1), so the dK/dV accumulator of the block a rank holds travels with the next K/V
block in one message, and the last block a rank holds is its own: its finished gradient needs
no hop home. Step 0 sends K/V alone, steps 1 .. cp - 2 K/V and dK/dV together, step cp - 1
dK/dV alone: 2 (cp - 1) blocks' worth of bytes in cp messages. Every message is started before
the step's block is computed and waited for after it. The accumulator stays in the compute
precision (fp32, fp64 for fp64 inputs) on the wire, where Transformer Engine sends it in the
K/V dtype.

The backward is FlashAttention's (Dao 2023, FlashAttention-2, Alg. 2): with P = exp(S - lse)
and D = rowsum(dO * O), dV = P^T dO, dS = P * (dO V^T - D), dQ = dS K / sqrt(d),
dK = dS^T Q / sqrt(d).

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

from aihpc.runspec.errors import SpecError

__all__ = ["load_balanced_layout", "load_balanced_positions", "ring_attention"]

# gloo matches messages between two ranks by tag; NCCL ignores tags (it orders by issue).
_TAG_FWD, _TAG_BWD = 0, 1


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


def load_balanced_layout(seq_len: int, cp: int) -> torch.Tensor:
    """Every CP rank's positions under :func:`load_balanced_positions`: (cp, seq_len / cp)
    int64, row r the positions of rank r's tokens (the table :func:`ring_attention` takes)."""
    return torch.stack([load_balanced_positions(seq_len, cp, r) for r in range(cp)])


class _Ring:
    """The CP group's ring: this rank's place in it, the neighbours it sends to and receives
    from (as global ranks), and one exchange step. ``reverse``: send to the previous rank."""

    def __init__(self, group: Any, reverse: bool = False) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        step = -1 if reverse else 1
        self.next = dist.get_global_rank(group, (self.rank + step) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - step) % self.size)

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


def _pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One message holding ``tensors`` (of any dtypes) end to end as bytes; a lone tensor is
    sent as it is. Put the widest dtype first, so that every view back lands aligned."""
    if len(tensors) == 1:
        return tensors[0].contiguous()
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])


def _unpack(message: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors of a message packed by :func:`_pack` from tensors shaped as ``like``."""
    if len(like) == 1:
        return [message]
    out, at = [], 0
    for t in like:
        n = t.numel() * t.element_size()
        out.append(message[at : at + n].view(t.dtype).view(t.shape))
        at += n
    return out


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
        table = positions.to(device=q.device, dtype=torch.int64)  # (cp, s): every rank's
        q_pos = table[ring.rank]
        qg = _group_rows(q, kvh, cdt)
        kv = torch.stack([k, v]).contiguous()  # (2, b, kvh, s, d): one message per hop
        out = torch.zeros_like(qg)  # normalised by the running lse
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=cdt, device=q.device)
        for step in range(ring.size):
            last = step == ring.size - 1
            if not last:  # the next block travels while this one is computed
                kv_next, works = ring.shift(kv, _TAG_FWD)
            k_pos = table[(ring.rank - step) % ring.size]  # the block of rank r - step
            sc = _masked_scores(qg, kv[0].to(cdt), q_pos, k_pos, scale)
            new = torch.logaddexp(lse, torch.logsumexp(sc, dim=-1))
            safe = _finite(new)
            p = torch.exp(sc - safe[..., None])  # probabilities under the merged normaliser
            out = out * torch.exp(lse - safe)[..., None] + torch.matmul(p, kv[1].to(cdt))
            lse = new
            if not last:
                _wait(works)
                kv = kv_next
        out = out.reshape(b, h, s, d).to(q.dtype)
        ctx.group = group
        # kv: the block of rank r + 1, where the backward's turned-round ring starts
        ctx.save_for_backward(q, kv, out, lse, table)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse, table = ctx.saved_tensors
        b, h, s, d = q.shape
        kvh = kv.shape[2]
        cdt = lse.dtype
        scale = 1.0 / math.sqrt(d)
        ring = _Ring(ctx.group, reverse=True)  # K/V and dK/dV go to rank r - 1
        n = ring.size
        q_pos = table[ring.rank]
        qg, dog = _group_rows(q, kvh, cdt), _group_rows(dout, kvh, cdt)
        delta = (dog * _group_rows(out, kvh, cdt)).sum(-1, keepdim=True)  # D = rowsum(dO * O)
        lse_safe = _finite(lse)[..., None]
        dq = torch.zeros_like(qg)
        acc = None  # dK, dV of the block held: every share so far, from ranks r + 1 onwards
        for step in range(n):
            # this message: the last block's dK/dV for rank r - 1, which holds that block now,
            # and this block's K/V for the next step (the widest dtype first, see _pack)
            send = ([acc] if step > 0 else []) + ([kv] if step < n - 1 else [])
            if send:
                message, works = ring.shift(_pack(send), _TAG_BWD)
            kb, vb = kv[0].to(cdt), kv[1].to(cdt)
            held = table[(ring.rank + 1 + step) % n]  # the block of rank r + 1 + step
            p = torch.exp(_masked_scores(qg, kb, q_pos, held, scale) - lse_safe)
            ds = p * (torch.matmul(dog, vb.transpose(-1, -2)) - delta)
            dq += torch.matmul(ds, kb) * scale
            # this rank's share of the held block's dK, dV (summed over the head group)
            mine = torch.stack([torch.matmul(ds.transpose(-1, -2), qg) * scale,
                                torch.matmul(p.transpose(-1, -2), dog)])  # fmt: skip
            if not send:  # cp = 1
                acc = mine
                continue
            _wait(works)
            got = _unpack(message, send)
            acc = got[0] + mine if step > 0 else mine  # rank r + 1 held this block before us
            if step < n - 1:
                kv = got[-1]
        dq = dq.reshape(b, h, s, d).to(q.dtype)  # acc: this rank's own block, every share
        return dq, acc[0].to(kv.dtype), acc[1].to(kv.dtype), None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: Any, positions: torch.Tensor
) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence, K/V passed around
    ``group`` (a ProcessGroup, any subgroup of the world).

    q: (batch, heads, s_local, head_dim); k, v: (batch, kv_heads, s_local, head_dim) with heads a
    multiple of kv_heads; positions: (cp, s_local), row c the global positions of the tokens of
    the group's rank c (this rank's row among them; :func:`load_balanced_layout` gives the
    trainer's). Returns (batch, heads, s_local, head_dim), full causal
    softmax(q k^T / sqrt(head_dim)) v at this rank's positions, computed in fp32 (fp64 for fp64
    inputs) and returned in q's dtype. Differentiable in q, k, v; safe to recompute under
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
    if positions.dim() != 2 or positions.shape[1] != s:
        raise ValueError(
            f"ring_attention: positions {tuple(positions.shape)}: expected (cp, {s}), a row of "
            "global positions for each rank of the CP group (load_balanced_layout gives one)"
        )
    cp = dist.get_world_size(group)
    if positions.shape[0] != cp:
        raise ValueError(
            f"ring_attention: positions has {positions.shape[0]} rows for a CP group of {cp} "
            "ranks: give one row of global positions per rank of the group"
        )
    return _RingAttention.apply(q, k, v, positions, group)
