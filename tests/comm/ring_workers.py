"""Spawned workers for the ring attention tests: 4 real gloo processes, no mocks.

Every rank regenerates the whole sequence's q, k, v and dout from the case's seed, computes the
single-process reference (full-sequence SDPA, causal, float64) itself and compares the slice at
its own positions with what the ring gives.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from aihpc.bench.dist import init_distributed
from aihpc.comm.ring import load_balanced_layout, ring_attention

BATCH, HEAD_DIM, CHUNK = 2, 8, 4  # CHUNK: tokens per half-chunk, so seq = 2 * cp * CHUNK

# name: CP groups (each a list of world ranks; the 4 ranks split among them), heads, kv_heads,
# dtype, layout ("balanced": load_balanced_layout; "contiguous": rank r holds the r-th slice,
# so some blocks are entirely in a query's future), recompute under checkpoint.
CASES: dict[str, dict[str, Any]] = {
    "cp4": {"groups": [[0, 1, 2, 3]], "heads": 4, "kv_heads": 4},
    "cp4-gqa": {"groups": [[0, 1, 2, 3]], "heads": 4, "kv_heads": 2},
    "cp2-adjacent": {"groups": [[0, 1], [2, 3]], "heads": 4, "kv_heads": 4},
    "cp2-strided": {"groups": [[0, 2], [1, 3]], "heads": 4, "kv_heads": 4},
    "cp2-strided-gqa": {"groups": [[0, 2], [1, 3]], "heads": 4, "kv_heads": 2},
    "cp4-mqa-contiguous": {"groups": [[0, 1, 2, 3]], "heads": 4, "kv_heads": 1,
                           "layout": "contiguous"},
    "cp1": {"groups": [[0], [1], [2], [3]], "heads": 4, "kv_heads": 2},
    "cp4-fp32": {"groups": [[0, 1, 2, 3]], "heads": 4, "kv_heads": 2, "dtype": torch.float32},
    "cp4-bf16": {"groups": [[0, 1, 2, 3]], "heads": 4, "kv_heads": 2, "dtype": torch.bfloat16},
    "cp4-checkpoint": {"groups": [[0, 1, 2, 3]], "heads": 4, "kv_heads": 2, "checkpoint": True},
    "cp2-strided-checkpoint": {"groups": [[0, 2], [1, 3]], "heads": 4, "kv_heads": 2,
                               "checkpoint": True},
}  # fmt: skip


def _layout(layout: str, seq: int, cp: int) -> torch.Tensor:
    """(cp, seq / cp): row c the global positions of CP rank c's tokens."""
    if layout == "contiguous":
        return torch.arange(seq).view(cp, seq // cp)
    return load_balanced_layout(seq, cp)


def _inputs(seed: int, heads: int, kv_heads: int, seq: int) -> list[torch.Tensor]:
    """q, k, v, dout of the whole sequence, float64."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(BATCH, heads, seq, HEAD_DIM), (BATCH, kv_heads, seq, HEAD_DIM)]
    return [torch.randn(shapes[i], generator=g, dtype=torch.float64) for i in (0, 1, 1, 0)]


def _reference(q, k, v, dout) -> list[torch.Tensor]:
    """Full causal attention in one process: out, dq, dk, dv over the whole sequence."""
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
    )
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


class _SentMessages:
    """Records the bytes of every message this rank sends through dist.batch_isend_irecv (the
    ring's only way to send) while in the ``with`` block."""

    def __enter__(self) -> list[int]:
        self.sizes: list[int] = []
        self.real = dist.batch_isend_irecv

        def counting(ops: list[Any]) -> list[Any]:
            for op in ops:
                if op.op is dist.isend:
                    self.sizes.append(op.tensor.numel() * op.tensor.element_size())
            return self.real(ops)

        dist.batch_isend_irecv = counting
        return self.sizes

    def __exit__(self, *exc: Any) -> None:
        dist.batch_isend_irecv = self.real


def _ring(q, k, v, dout, group, table, recompute: bool) -> tuple[list[torch.Tensor], list[Any]]:
    """Output and gradients, and the bytes of each message sent in the forward, the backward."""
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    core = functools.partial(ring_attention, group=group, positions=table)
    with _SentMessages() as fwd:
        out = checkpoint(core, q, k, v, use_reentrant=False) if recompute else core(q, k, v)
    with _SentMessages() as bwd:
        out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad], [fwd, bwd]


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def _run_case(name: str, case: dict[str, Any], rank: int) -> dict[str, Any]:
    groups = [dist.new_group(ranks) for ranks in case["groups"]]  # every rank makes every group
    mine = next(i for i, ranks in enumerate(case["groups"]) if rank in ranks)
    group, members = groups[mine], case["groups"][mine]
    cp, cp_rank = len(members), members.index(rank)
    seq = 2 * cp * CHUNK
    seed = 100 * len(name) + mine  # each group its own data
    full = _inputs(seed, case["heads"], case["kv_heads"], seq)
    ref = _reference(*full)
    table = _layout(case.get("layout", "balanced"), seq, cp)
    pos = table[cp_rank]
    dtype = case.get("dtype", torch.float64)
    local = [t[:, :, pos].to(dtype) for t in full]
    got, sent = _ring(*local, group, table, case.get("checkpoint", False))
    res: dict[str, Any] = {
        "errors": {n: _max_err(g, r[:, :, pos]) for n, g, r in zip("oqkv", got, ref, strict=True)},
        "dtypes": [str(g.dtype) for g in got],
        "positions": pos.tolist(),
        "cp_rank": cp_rank,
        "cp": cp,
        "sent_bytes": sent,  # each message's, forward and backward
        "kv_bytes": 2 * local[1].numel() * local[1].element_size(),  # this rank's K and V
    }
    if dtype != torch.float64:
        # the same inputs, rounded to dtype, through single-process SDPA in dtype: the rounding
        # error of plain attention at this precision, the yardstick for the ring's
        sdpa = _reference(*(t.to(dtype) for t in full))
        res["sdpa_errors"] = {
            n: _max_err(s[:, :, pos], r[:, :, pos])
            for n, s, r in zip("oqkv", sdpa, ref, strict=True)
        }
    if case.get("checkpoint"):  # recompute must give bitwise the gradients of the plain ring
        plain, _ = _ring(*local, group, table, False)
        res["same_as_plain"] = all(torch.equal(a, b) for a, b in zip(got, plain, strict=True))
    return res


def ring_checks(cases: list[str]) -> list[dict[str, Any]]:
    """Run the named cases on every rank; rank 0 returns all ranks' results."""
    with init_distributed(60.0) as ctx:
        out = {name: _run_case(name, CASES[name], ctx.rank) for name in cases}
        gathered: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(gathered, out)
        return gathered
