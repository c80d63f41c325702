"""One sparse all-to-all step ("route") and its adjoint, the building block of MoE dispatch/combine.

A route sends each local row to a *set* of peers, at most once per peer, whatever number of the
row's top-k experts live on that peer (DeepEP's normal kernels send a token once per destination
rank, ``is_token_in_rank`` in deepseek-ai/DeepEP tests/test_intranode.py; Megatron-Core's
all-to-all dispatcher sends one copy per (token, expert) instead). Its adjoint, the reduce, sends
the rows back and sums, per source row, what every peer returned. The two are transposes of one
linear map, so the backward of one is the forward of the other (DeepEP README: "the backward of
MoE dispatch is actually a combine", and vice versa).

The steps of a route, for ``dest`` of shape (rows, k) holding a peer per slot (-1: none):

1. destinations per row, de-duplicated, in ascending peer order (a row's "slot" is its ordinal
   among its own destinations);
2. send order (peer, row): rows for peer 0 first, each peer's rows in row order;
3. the count exchange: one ``all_to_all_single`` of a (peers, 1 + X) int64 matrix, the row count
   per peer plus X per-expert pair counts the caller supplies, so a receiver knows how many rows
   and how many tokens per expert arrive before the data does (Megatron-Core exchanges per-expert
   counts the same way, ``MoEAlltoAllTokenDispatcher.preprocess``);
4. the data: one ``all_to_all_single`` with uneven splits, every row field (token, top-k expert
   ids, weights, source rank) packed into one byte row so a token travels as one message, as
   DeepEP packs them.

A route without a group is a local permutation (the same code serves the grouping of received
tokens by local expert). The reduce sums a row's returned copies in peer order: on a GPU with
one ``index_add_`` per slot, so every call sees each output row at most once and the result is
bitwise reproducible (a single scatter-add with repeated indices is not); on a CPU in one
``index_add_`` over the rows in send order, which adds them sequentially in that same order.
Half-precision rows are summed in float32 and the sum is rounded to their dtype once, at the
end of the route (so a two-stage combine rounds each rank's partial sum before the next
stage: ``aihpc.comm.moe_dispatch``).

This module imports torch only (the project's rule for ``aihpc.comm``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "Route",
    "combine_stage",
    "dispatch_stage",
    "plan_route",
    "route_forward",
    "route_reduce",
]


@dataclass
class Route:
    """One all-to-all-v: which local rows go to which peer, in which order, and what comes back.

    ``group`` None means no communication: the "peers" are buckets of a local permutation and
    what is sent is what is received.
    """

    group: Any  # a torch.distributed ProcessGroup, or None (local permutation)
    num_rows: int  # rows before the route (the length of the reduce's output)
    send_rows: torch.Tensor  # (S,) int64: the local row of every sent copy, in send order
    send_cols: torch.Tensor  # (S,) int64: the column of ``dest`` the copy came from
    send_counts: list[int]  # copies per peer (a local permutation: per bucket)
    recv_counts: list[int]  # rows received from each peer (a local permutation: send_counts)
    # per slot j, (positions in send order, their rows) of the copies that are slot j of their row
    slot_index: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # per peer, the X per-expert pair counts received in the count exchange (None: none sent)
    recv_expert_counts: list[list[int]] | None = None

    @property
    def num_sent(self) -> int:
        return int(self.send_rows.numel())

    @property
    def num_received(self) -> int:
        return sum(self.recv_counts)


def _all_to_all(
    out: torch.Tensor, inp: torch.Tensor, out_counts: list[int], in_counts: list[int], group: Any
) -> None:
    dist.all_to_all_single(
        out,
        inp.contiguous(),
        output_split_sizes=out_counts,
        input_split_sizes=in_counts,
        group=group,
    )


def plan_route(
    dest: torch.Tensor,
    num_peers: int,
    group: Any = None,
    expert_counts: torch.Tensor | None = None,
    row_key: torch.Tensor | None = None,
    key_range: int = 1,
) -> Route:
    """Plan a route for ``dest`` (rows, k) int64, peer of each slot or -1; exchange the counts.

    ``expert_counts`` (num_peers, X) int64: per-expert pair counts for the experts behind each
    peer, sent with the row counts (step 3 above). ``row_key`` (rows,) in [0, key_range): rows
    bound for one peer are ordered by (key, row) instead of row (the receiver uses it to order
    tokens by source rank whatever path they took).
    """
    n, k = dest.shape
    device = dest.device
    peers, cols = dest.sort(dim=1, stable=True)
    first = torch.ones_like(peers, dtype=torch.bool)
    first[:, 1:] = peers[:, 1:] != peers[:, :-1]
    keep = first & (peers >= 0)
    slots = keep.cumsum(dim=1) - 1
    # No boolean-mask compaction, nonzero or bincount here: each of those reads a size on the
    # host, a device sync on a GPU (the route had a dozen; one dispatch spent ~4.7 ms on an
    # H200 where its kernels took ~0.6). Every (row, slot) pair is sorted instead, the pairs
    # not sent last, and the one host read below says how many lead.
    rows = torch.arange(n, device=device).unsqueeze(1).expand(n, k)
    key = peers if row_key is None else peers * key_range + row_key[rows]
    key = torch.where(keep, key, num_peers * key_range).flatten()
    order = torch.argsort(key, stable=True)  # (key, row) order: the flat pairs are row-major
    sent_flat = keep.flatten().long()
    counts = torch.zeros(num_peers, dtype=torch.long, device=device)
    counts.scatter_add_(0, peers.clamp(min=0).flatten(), sent_flat)
    per_slot = torch.zeros(k, dtype=torch.long, device=device)
    per_slot.scatter_add_(0, slots.clamp(min=0).flatten(), sent_flat)
    recv_expert_counts = None
    if group is None:  # a local permutation: what bucket i is sent is what it receives
        host = torch.cat([counts, per_slot]).tolist()  # the route's one host sync
        send_counts = recv_counts = host[:num_peers]
        slot_counts = host[num_peers:]
    else:
        table = counts.unsqueeze(1)
        if expert_counts is not None:
            table = torch.cat([table, expert_counts.to(table.dtype)], dim=1)
        received = torch.empty_like(table)
        _all_to_all(received, table, [1] * num_peers, [1] * num_peers, group)
        # the stage's one host sync: what is sent, everything received, pairs per slot
        host = torch.cat([table[:, 0], per_slot, received.flatten()]).tolist()
        send_counts, slot_counts = host[:num_peers], host[num_peers : num_peers + k]
        got = host[num_peers + k :]
        width = table.shape[1]
        rows_in = [got[i * width : (i + 1) * width] for i in range(num_peers)]
        recv_counts = [r[0] for r in rows_in]
        if expert_counts is not None:
            recv_expert_counts = [r[1:] for r in rows_in]
    sel = order[: sum(send_counts)]
    send_rows, send_cols = rows.flatten()[sel], cols.flatten()[sel]
    # per slot j, the positions in send order of the copies that are slot j of their row,
    # ascending: a stable sort by slot, cut by the counts read above
    by_slot = torch.argsort(slots.flatten()[sel], stable=True)
    slot_index, start = [], 0
    for c in slot_counts:
        if c == 0:
            break  # a row's slots are 0, 1, ...: no slot j means no slot above j either
        pos = by_slot[start : start + c]
        slot_index.append((pos, send_rows[pos]))
        start += c
    return Route(
        group, n, send_rows, send_cols, send_counts, recv_counts, slot_index, recv_expert_counts
    )


# -- packing: every field of a row in one byte row, so one all-to-all moves a token -----------


def _pack(parts: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, int, Any, tuple]]]:
    """Rows of several tensors (same length, any dtypes) → one (rows, B / 8) int64 tensor.

    Fields go in descending element size so each starts aligned for its own dtype; B is padded
    to 8 bytes so the row fits whole int64 words.
    """
    n = parts[0].shape[0]
    order = sorted(range(len(parts)), key=lambda i: -parts[i].element_size())
    layout: list[Any] = [None] * len(parts)
    views, offset = [], 0
    for i in order:
        p = parts[i].reshape(n, math.prod(parts[i].shape[1:])).contiguous()
        b = p.view(torch.uint8) if p.shape[1] else p.new_empty((n, 0), dtype=torch.uint8)
        layout[i] = (offset, b.shape[1], parts[i].dtype, tuple(parts[i].shape[1:]))
        views.append(b)
        offset += b.shape[1]
    pad = -offset % 8
    if pad:
        views.append(parts[0].new_zeros((n, pad), dtype=torch.uint8))
    # moved as int64 words: row gathers and collectives on bytes run element by element
    return torch.cat(views, dim=1).view(torch.int64), layout


def _unpack(buf: torch.Tensor, layout: list[tuple[int, int, Any, tuple]]) -> list[torch.Tensor]:
    buf = buf.view(torch.uint8)
    n, out = buf.shape[0], []
    for offset, width, dtype, shape in layout:
        if width == 0:
            out.append(torch.empty((n, *shape), dtype=dtype, device=buf.device))
            continue
        out.append(buf[:, offset : offset + width].view(dtype).reshape(n, *shape).contiguous())
    return out


def route_forward(parts: list[torch.Tensor], route: Route) -> list[torch.Tensor]:
    """Send every row of every part to its peers (one copy per (row, peer)); return what
    arrives, rows from peer 0 first."""
    if route.group is None:
        return [p.index_select(0, route.send_rows) for p in parts]
    if len(parts) == 1:  # one tensor: no packing
        sent = parts[0].index_select(0, route.send_rows)
        out = sent.new_empty((route.num_received, *sent.shape[1:]))
        _all_to_all(out, sent, route.recv_counts, route.send_counts, route.group)
        return [out]
    # pack the rows once, then copy each row out once per destination (a token goes to several
    # peers: packing after the selection would copy every copy twice)
    buf, layout = _pack(parts)
    sent = buf.index_select(0, route.send_rows)
    out = buf.new_empty((route.num_received, buf.shape[1]))
    _all_to_all(out, sent, route.recv_counts, route.send_counts, route.group)
    return _unpack(out, layout)


# rows converted to float32 at a time by the CPU sum: a small buffer reused, instead of a float32
# copy of every row (allocating and first touching that copy cost more than the sum itself)
_CPU_CHUNK_ROWS = 1024


def _sum_slots(back: torch.Tensor, route: Route) -> torch.Tensor:
    """Sum returned copies into their source rows in slot order (a row's copies in ascending
    peer order). 16-bit floats accumulate in float32; the result has ``back``'s dtype.

    GPU: one index_add_ per slot (no repeated index within a call, so no atomics race). CPU:
    index_add_ adds the source rows one after another in index order, and the send order is
    peer-major, so one pass over ``back`` in send order adds each row's copies in slot order:
    the same sum, bit for bit, without gathering each slot's rows first."""
    acc = torch.float32 if back.dtype in (torch.float16, torch.bfloat16) else back.dtype
    out = back.new_zeros((route.num_rows, *back.shape[1:]), dtype=acc)
    if back.device.type != "cpu":
        for pos, rows in route.slot_index:
            part = back.index_select(0, pos)
            out.index_add_(0, rows, part if part.dtype == acc else part.to(acc))
        return out.to(back.dtype)
    rows = route.send_rows
    if back.dtype == acc:
        return out.index_add_(0, rows, back)
    buf = back.new_empty((min(_CPU_CHUNK_ROWS, len(back)), *back.shape[1:]), dtype=acc)
    for start in range(0, len(back), _CPU_CHUNK_ROWS):
        part = back[start : start + _CPU_CHUNK_ROWS]
        out.index_add_(0, rows[start : start + len(part)], buf[: len(part)].copy_(part))
    return out.to(back.dtype)


def route_reduce(parts: list[torch.Tensor], route: Route) -> list[torch.Tensor]:
    """The adjoint of ``route_forward``: send received rows back, sum each source row's copies."""
    if route.group is not None and len(parts) == 1:
        back = parts[0].new_empty((route.num_sent, *parts[0].shape[1:]))
        _all_to_all(back, parts[0], route.send_counts, route.recv_counts, route.group)
        parts = [back]
    elif route.group is not None:
        buf, layout = _pack(parts)
        back = buf.new_empty((route.num_sent, buf.shape[1]))
        _all_to_all(back, buf, route.send_counts, route.recv_counts, route.group)
        parts = _unpack(back, layout)
    return [_sum_slots(p, route) for p in parts]


class _DispatchStage(torch.autograd.Function):
    """(x, w, meta) rows → their copies at the peers. Backward: the reduce of (dx, dw)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, meta: torch.Tensor, route: Route):  # type: ignore[override]
        ctx.route = route
        meta_out, x_out, w_out = route_forward([meta, x, w], route)
        ctx.mark_non_differentiable(meta_out)
        return x_out, w_out, meta_out

    @staticmethod
    def backward(ctx: Any, gx: torch.Tensor, gw: torch.Tensor, _gmeta: Any):  # type: ignore[override]
        gx_in, gw_in = route_reduce([gx.contiguous(), gw.contiguous()], ctx.route)
        return gx_in, gw_in, None, None


class _CombineStage(torch.autograd.Function):
    """Rows at the peers → summed into their source rows. Backward: the dispatch of the grad."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, route: Route):  # type: ignore[override]
        ctx.route = route
        return route_reduce([y], route)[0]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):  # type: ignore[override]
        return route_forward([g.contiguous()], ctx.route)[0], None


def dispatch_stage(
    x: torch.Tensor, weights: torch.Tensor, meta: torch.Tensor, route: Route
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Autograd-aware ``route_forward`` of tokens ``x`` (rows, h), their ``weights`` (rows, k)
    (may have 0 columns) and integer ``meta`` (rows, m); returns (x, weights, meta) received."""
    return _DispatchStage.apply(x, weights, meta, route)


def combine_stage(y: torch.Tensor, route: Route) -> torch.Tensor:
    """Autograd-aware ``route_reduce`` of one tensor."""
    return _CombineStage.apply(y, route)
