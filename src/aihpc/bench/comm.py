"""Collective benchmark with nccl-tests semantics over torch.distributed (NCCL on GPU, gloo on CPU).

For every collective and size: ``warmup`` untimed operations, a barrier, ``iters`` back-to-back
operations timed on the host wall clock with one device sync at the end, time per operation
averaged over all ranks (nccl-tests ``BenchTime``, ``-a 1``). Out-of-place then in-place. Then,
on freshly filled buffers, one checked operation: inputs are small integers whose reduction is
exact in the data type whatever the reduction order, the expected output is computed
independently on each rank, and the number of elements that differ (zero tolerance) is summed over
all ranks into ``#wrong`` (nccl-tests ``verifiable/``). Check runs never pollute timings.

PyTorch has no out-of-place all_reduce: the out-of-place column copies the input into the output
buffer and reduces that, which is what a PyTorch program pays for a fresh result tensor. In-place
all_to_all and send/recv (one buffer as both input and output) are not defined by
torch.distributed: the check measured wrong data for them with gloo (send and receive race on the
one buffer), so their in-place column is reported as N/A rather than timed.
"""

# ruff: noqa: UP031  (printf-style on purpose: these are nccl-tests' C formats, verbatim)

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from aihpc.bench.collectives import (
    DTYPE_BYTES,
    RowTiming,
    algbw_GBps,
    busbw_factor,
    element_counts,
    is_reducing,
)
from aihpc.bench.comm_config import GROUPS, CommConfig, group_layout, validate_comm_config
from aihpc.bench.dist import DistContext, init_distributed, run_facts

__all__ = [
    "GROUPS",
    "CommConfig",
    "CommResult",
    "device_lines",
    "results_json",
    "run_comm_bench",
    "validate_comm_config",
]

TORCH_DTYPES = {
    "float": torch.float32,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "double": torch.float64,
    "int32": torch.int32,
    "int64": torch.int64,
}
_TORCH_OPS = {
    "sum": dist.ReduceOp.SUM,
    "prod": dist.ReduceOp.PRODUCT,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "avg": dist.ReduceOp.AVG,
}
# largest integer every value up to which the type holds exactly (mantissa bits + 1)
_EXACT_INT = {
    "float": 2**24,
    "half": 2**11,
    "bfloat16": 2**8,
    "double": 2**53,
    "int32": 2**31 - 1,
    "int64": 2**62,
}
_NO_IN_PLACE = ("all_to_all", "send_recv")
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class CommResult:
    collective: str
    tier: str
    group: str
    num_ranks: int
    ranks_per_domain: int
    size_bytes: int
    count: int
    dtype: str
    redop: str
    root: int
    out_of_place: RowTiming
    in_place: RowTiming | None  # None where torch.distributed has no in-place form

    def to_json(self) -> dict[str, Any]:
        """One object per size and collective; the headline figures are out-of-place."""
        oop = asdict(self.out_of_place)
        return {
            "collective": self.collective,
            "tier": self.tier,
            "group": self.group,
            "num_ranks": self.num_ranks,
            "ranks_per_domain": self.ranks_per_domain,
            "size_bytes": self.size_bytes,
            "count": self.count,
            "dtype": self.dtype,
            "redop": self.redop,
            "root": self.root,
            **oop,
            "in_place": asdict(self.in_place) if self.in_place else None,
        }


@dataclass
class _Group:
    """The sub-group this rank measures in, and what it is."""

    pg: Any  # None = the default (world) group
    ranks: list[int]  # global ranks, in group-rank order
    tier: str
    ranks_per_domain: int  # members of the group on one node (what the scale-out NICs share)
    rank: int = field(init=False)

    def __post_init__(self) -> None:
        self.rank = self.ranks.index(dist.get_rank())


def _make_group(ctx: DistContext, cfg: CommConfig) -> _Group:
    if cfg.ranks_per_node:
        node_of = [r // cfg.ranks_per_node for r in range(ctx.world_size)]
    else:
        order = list(dict.fromkeys(ctx.hostnames))
        node_of = [order.index(h) for h in ctx.hostnames]
    lists, tier, per_domain = group_layout(cfg, node_of)
    if cfg.group == "world":
        return _Group(None, lists[0], tier, per_domain)
    # every rank must create every group, in the same order (torch.distributed's rule)
    pgs = [dist.new_group(ranks) for ranks in lists]
    mine = next(i for i, ranks in enumerate(lists) if ctx.rank in ranks)
    return _Group(pgs[mine], lists[mine], tier, per_domain)


def _values(idx: torch.Tensor, r: int, n: int, op: str, dtype: str, seed: int) -> torch.Tensor:
    """Input element ``idx`` of group rank ``r``: small integers chosen so that the reduction over
    n ranks is exact in ``dtype`` in any order (int64 result; cast by the caller)."""
    h = (idx * 7 + r * 13 + seed * 5) % 1021
    if op == "prod":  # +-1: any product is exact
        return torch.where(h % 7 == 0, -1, 1)
    if op == "avg":  # the same value everywhere: sum n*v and the division by n are exact
        k = max(1, min(64, _EXACT_INT[dtype] // (2 * n)))
        return ((idx * 7 + seed * 5) % (2 * k + 1)) - k
    if op in ("max", "min"):
        return h % 255 - 127
    # sum: at most c ranks contribute, each |v| <= k, so every partial sum is <= c*k <= exact limit
    c = min(n, _EXACT_INT[dtype])
    k = max(1, min(1000, _EXACT_INT[dtype] // c))
    v = h % (2 * k + 1) - k
    return torch.where((r - idx) % n < c, v, torch.zeros_like(v))


def _reduce(parts: list[torch.Tensor], op: str, n: int) -> torch.Tensor:
    out = parts[0].clone()
    for p in parts[1:]:
        if op in ("sum", "avg"):
            out += p
        elif op == "prod":
            out *= p
        elif op == "max":
            out = torch.maximum(out, p)
        else:
            out = torch.minimum(out, p)
    return out // n if op == "avg" else out


class _Case:
    """Buffers, the operation and its expected result for one (collective, size, in-place)."""

    def __init__(
        self, coll: str, size: int, cfg: CommConfig, g: _Group, device: torch.device, in_place: bool
    ) -> None:
        self.coll, self.cfg, self.g, self.in_place = coll, cfg, g, in_place
        n, r = len(g.ranks), g.rank
        self.tdtype = TORCH_DTYPES[cfg.dtype]
        send, recv, self.count, self.size = element_counts(coll, size, DTYPE_BYTES[cfg.dtype], n)
        self.chunk = self.count
        if in_place:
            # one allocation; the input is the part of it nccl-tests' in-place offsets name
            self.buf = torch.empty(max(send, recv), dtype=self.tdtype, device=device)
            if coll == "all_gather":
                self.inp, self.out = self.buf.narrow(0, r * self.chunk, self.chunk), self.buf
            elif coll == "reduce_scatter":
                self.inp, self.out = self.buf, self.buf.narrow(0, r * self.chunk, self.chunk)
            else:
                self.inp = self.out = self.buf
        else:
            self.inp = torch.empty(send, dtype=self.tdtype, device=device)
            self.out = torch.empty(recv, dtype=self.tdtype, device=device)
        self.root_global = g.ranks[cfg.root % n]
        self.op = _TORCH_OPS[cfg.op]

    def _gen(self, idx_start: int, length: int, r: int, seed: int) -> torch.Tensor:
        idx = torch.arange(idx_start, idx_start + length, device=self.inp.device)
        op = self.cfg.op if is_reducing(self.coll) else "max"
        return _values(idx, r, len(self.g.ranks), op, self.cfg.dtype, seed)

    def fill(self, seed: int) -> None:
        self.out.zero_()
        self.inp.copy_(self._gen(0, self.inp.numel(), self.g.rank, seed))

    def expected(self, seed: int) -> torch.Tensor:
        n, r, c = len(self.g.ranks), self.g.rank, self.chunk
        op = self.cfg.op
        if self.coll == "all_reduce":
            return _reduce([self._gen(0, self.count, j, seed) for j in range(n)], op, n)
        if self.coll == "reduce_scatter":
            return _reduce([self._gen(r * c, c, j, seed) for j in range(n)], op, n)
        if self.coll == "all_gather":
            return torch.cat([self._gen(0, c, j, seed) for j in range(n)])
        if self.coll == "all_to_all":
            return torch.cat([self._gen(r * c, c, j, seed) for j in range(n)])
        if self.coll == "broadcast":
            return self._gen(0, self.count, self.cfg.root % n, seed)
        return self._gen(0, self.count, (r - 1) % n, seed)  # send_recv from the previous rank

    def run(self) -> None:
        pg, coll = self.g.pg, self.coll
        if coll == "all_reduce":
            if not self.in_place:
                self.out.copy_(self.inp)
            dist.all_reduce(self.out, op=self.op, group=pg)
        elif coll == "all_gather":
            _all_gather(self.out, self.inp, group=pg)
        elif coll == "reduce_scatter":
            _reduce_scatter(self.out, self.inp, op=self.op, group=pg)
        elif coll == "all_to_all":
            dist.all_to_all_single(self.out, self.inp, group=pg)
        elif coll == "broadcast":
            # out-of-place: the root sends from its input buffer, the others receive into theirs
            is_root = dist.get_rank() == self.root_global
            buf = self.inp if (is_root and not self.in_place) else self.out
            dist.broadcast(buf, src=self.root_global, group=pg)
        else:  # send_recv: to the next rank of the ring, from the previous one, in one group
            n, r = len(self.g.ranks), self.g.rank
            ops = [
                dist.P2POp(dist.isend, self.inp, self.g.ranks[(r + 1) % n], group=pg),
                dist.P2POp(dist.irecv, self.out, self.g.ranks[(r - 1) % n], group=pg),
            ]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def result_view(self) -> torch.Tensor:
        if self.coll == "broadcast" and dist.get_rank() == self.root_global and not self.in_place:
            return self.inp  # the root's data never moves in an out-of-place broadcast
        return self.out


def _time_case(case: _Case, ctx: DistContext, cfg: CommConfig) -> float:
    """Average seconds per operation over all ranks (nccl-tests -a 1)."""
    for _ in range(cfg.warmup):
        case.run()
    ctx.sync()
    dist.barrier(group=case.g.pg)
    t0 = time.perf_counter()
    for _ in range(cfg.iters):
        case.run()
    ctx.sync()
    dt = torch.tensor(
        [(time.perf_counter() - t0) / cfg.iters], dtype=torch.float64, device=ctx.device
    )
    dist.all_reduce(dt)
    return float(dt.item()) / ctx.world_size


def _check_case(case: _Case, ctx: DistContext, cfg: CommConfig, seed: int) -> int:
    """Wrong elements summed over all ranks, zero tolerance."""
    case.fill(seed)
    case.run()
    ctx.sync()
    got = case.result_view()
    if cfg.corrupt_rank == ctx.rank and got.numel():
        got.view(-1)[got.numel() // 2] += 1  # the deliberate fault the tests look for
    want = case.expected(seed).to(case.tdtype)
    wrong = torch.tensor([int((got != want).sum().item())], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(wrong)
    return int(wrong.item())


def device_lines(ctx: DistContext) -> list[str]:
    """nccl-tests' '#  Rank ... device ...' lines, one per rank (gathered to every rank)."""
    if ctx.device.type == "cuda":
        p = torch.cuda.get_device_properties(ctx.device)
        bus = (
            f"{getattr(p, 'pci_domain_id', 0):04x}:{getattr(p, 'pci_bus_id', 0):02x}:"
            f"{getattr(p, 'pci_device_id', 0):02x}"
        )
        name, index = p.name, ctx.device.index or 0
    else:
        bus, name, index = "cpu", f"CPU {platform.machine()} (gloo)", ctx.local_rank
    mine = "#  Rank %2d Group %2d Pid %6d on %10s device %2d [%s] %s" % (
        ctx.rank,
        0,
        os.getpid(),
        ctx.hostnames[ctx.rank],
        index,
        bus,
        name,
    )
    lines: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(lines, mine)
    return [str(x) for x in lines]


def run_comm_bench(
    ctx: DistContext,
    cfg: CommConfig,
    on_result: Callable[[CommResult], None] | None = None,
    on_start: Callable[[str, int], None] | None = None,
) -> list[CommResult]:
    """Run the sweep on every rank; every rank returns the same results (times averaged)."""
    cfg = validate_comm_config(cfg, ctx.world_size)
    g = _make_group(ctx, cfg)
    n = len(g.ranks)
    results = []
    for coll in cfg.collectives:
        if on_start:
            on_start(coll, n)
        for seed, size in enumerate(cfg.sizes):
            halves: list[RowTiming | None] = []
            for in_place in (False, True):
                if in_place and coll in _NO_IN_PLACE:
                    halves.append(None)
                    continue
                case = _Case(coll, size, cfg, g, ctx.device, in_place)
                case.fill(seed)
                sec = _time_case(case, ctx, cfg)
                wrong = _check_case(case, ctx, cfg, seed + 1) if cfg.check else None
                time_us = sec * 1e6
                alg = algbw_GBps(case.size, time_us)
                halves.append(RowTiming(time_us, alg, alg * busbw_factor(coll, n), wrong))
            oop = halves[0]
            assert oop is not None  # out-of-place always runs
            res = CommResult(
                coll,
                g.tier,
                cfg.group,
                n,
                g.ranks_per_domain,
                case.size,
                case.count,
                cfg.dtype,
                cfg.op if is_reducing(coll) else "none",
                cfg.root if coll == "broadcast" else -1,
                oop,
                halves[1],
            )
            results.append(res)
            if on_result:
                on_result(res)
    # sub-groups are torn down with the default group by init_distributed()
    return results


def run_in_new_group(
    cfgs: Sequence[CommConfig], timeout_s: float = 300.0
) -> list[list[CommResult]]:
    """Join (or create) the process group, run each config in turn, tear the group down.

    Module level so that ``launch_local`` can start it in spawned workers.
    """
    with init_distributed(timeout_s) as ctx:
        return [run_comm_bench(ctx, cfg) for cfg in cfgs]


def results_json(results: Sequence[CommResult], ctx: DistContext, cfg: CommConfig) -> dict:
    rows = [r.to_json() for r in results]
    halves = [h for r in results for h in (r.out_of_place, r.in_place) if h is not None]
    busbws = [h.busbw_GBps for h in halves]
    wrong = [r for r in results if any(h.wrong for h in (r.out_of_place, r.in_place) if h)]
    return {
        "benchmark": "comm",
        **run_facts(ctx),
        "iters": cfg.iters,
        "warmup": cfg.warmup,
        "results": rows,
        "avg_busbw_GBps": sum(busbws) / len(busbws) if busbws else 0.0,
        "wrong_rows": len(wrong),
    }
