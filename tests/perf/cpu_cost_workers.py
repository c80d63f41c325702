"""Spawned workers for tests/perf/test_trainer_cpu_costs.py: what the trainer's ring attention
issues and moves on a CPU, counted on real gloo processes (no mocks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from aihpc.bench.dist import init_distributed
from aihpc.comm.ring import load_balanced_layout, ring_attention

# ops that move no element-wise bytes the model prices with the ring: its GEMMs (priced as
# the unfused attention's batched GEMMs) and views
NOT_STREAMED = {
    "mm", "bmm", "matmul", "addmm", "baddbmm", "_unsafe_view", "view", "t", "transpose",
    "expand", "unsqueeze", "select", "slice", "reshape", "permute", "as_strided", "alias",
    "_reshape_alias", "detach", "split", "unbind", "squeeze",
}  # fmt: skip


class Counter(TorchDispatchMode):
    """Every aten op, and the bytes of the tensors each element-wise op reads and writes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        if func.__name__.split(".")[0] not in NOT_STREAMED:
            flat = tree_flatten((args, kwargs, out))[0]
            self.bytes += sum(t.numel() * t.element_size() for t in flat if torch.is_tensor(t))
        return out


def ring_counts(shape: tuple[int, int, int, int, int]) -> dict[int, dict[str, int]]:
    """{cp: ops and bytes of one ring attention forward and backward} at cp 1 (each rank alone)
    and cp 2, fp32, for (batch, heads, kv_heads, seq, head_dim); rank 0's."""
    b, h, kvh, seq, d = shape
    out = {}
    with init_distributed(60.0) as ctx:
        singles = [dist.new_group([r]) for r in range(ctx.world_size)]
        for cp, group in ((1, singles[ctx.rank]), (2, dist.group.WORLD)):
            local = seq // cp
            gen = torch.Generator().manual_seed(ctx.rank)
            q = torch.randn(b, h, local, d, generator=gen, requires_grad=True)
            k = torch.randn(b, kvh, local, d, generator=gen, requires_grad=True)
            v = torch.randn(b, kvh, local, d, generator=gen, requires_grad=True)
            dout = torch.randn(b, h, local, d, generator=gen)
            layout = load_balanced_layout(seq, cp)  # the trainer builds it once, outside
            fwd, bwd = Counter(), Counter()
            with fwd:
                o = ring_attention(q, k, v, group=group, positions=layout)
            with bwd:
                o.backward(dout)
            out[cp] = {"fwd_ops": fwd.ops, "bwd_ops": bwd.ops, "fwd_bytes": fwd.bytes,
                       "bwd_bytes": bwd.bytes}  # fmt: skip
    return out
