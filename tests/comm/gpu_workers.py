"""GPU worker: our operators over NCCL (one rank per local GPU) against the CPU path."""

from __future__ import annotations

from typing import Any

import torch

from aihpc.bench.dist import init_distributed
from aihpc.comm import MoEDispatcher, build_ep_groups


def nccl_vs_cpu(experts: int = 16, tokens: int = 64, hidden: int = 32, k: int = 4) -> dict:
    """Dispatch and weighted combine on CUDA over NCCL, twice, and on the CPU without any
    group; the rows must be bitwise the CPU's, and the combine bitwise the same both times."""
    with init_distributed(120.0) as ctx:
        g = torch.Generator().manual_seed(ctx.rank)
        x = torch.randn((tokens, hidden), generator=g)
        idx = torch.rand((tokens, experts), generator=g).topk(k, dim=1).indices
        w = torch.rand((tokens, k), generator=g)
        gpu = MoEDispatcher(experts, build_ep_groups(ctx.world_size))
        out: dict[str, Any] = {"world": ctx.world_size}
        runs = []
        for _ in range(2):
            d = gpu.dispatch(x.cuda(), idx.cuda(), w.cuda())
            runs.append((d.x.cpu(), gpu.combine(d.x * 2, d.handle, d.weights).cpu()))
        out["deterministic"] = all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
        if ctx.world_size == 1:
            cpu = MoEDispatcher(experts)
            d = cpu.dispatch(x, idx, w)
            out["rows_equal_cpu"] = torch.equal(runs[0][0], d.x)
            combined = cpu.combine(d.x * 2, d.handle, d.weights)
            out["combine_equal_cpu"] = torch.equal(runs[0][1], combined)
        return out
