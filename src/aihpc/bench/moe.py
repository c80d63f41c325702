"""MoE dispatch / combine benchmark, measured as DeepEP's tests measure it.

Setting (deepseek-ai/DeepEP tests/test_intranode.py and test_internode.py): every rank holds
``tokens`` tokens of ``hidden`` values; scores ``|N(0,1)| + 1`` over ``experts`` experts (rounded
down to a multiple of the ranks), top-``topk`` per token; with several nodes the routing is
node-limited as DeepSeek-V3's: experts grouped by node, a token keeps its ``topk_groups`` best
nodes (by each node's best score; DeepEP's default ``min(num_nodes, 4)``), then its top-k
inside them. Random routing of this kind is close to balanced, as the published MoE benchmarks
force it.

Figures per rank, as DeepEP prints them (bytes / 1e9 / seconds, the mean over ranks):

* ``GB/s``: the token bytes a rank receives in the dispatch (DeepEP: ``recv_x.numel() * 2``, its
  "NVL" bandwidth), the same bytes it sends back in the combine. DeepEP calls it a logical
  bandwidth: it includes a rank's tokens for its own experts.
* ``xnode GB/s``: the token bytes a rank sends to ranks on other nodes (what its NIC carries),
  for every implementation; ``rdma_GBps`` in the JSON is DeepEP's internode definition for the
  hierarchical path (token rows sent by the inter-node stage, one per token and destination node,
  its own node included: ``num_rdma_token_sent * hidden * 2``).

Implementations side by side: ``ours`` (aihpc.comm, flat), ``ours_hier`` (aihpc.comm,
hierarchical; needs 2+ nodes, emulated with ``ranks_per_node``) and ``a2a_single``: the plain
dispatcher on torch's ``all_to_all_single`` (sort by expert, exchange counts, one copy per
(token, expert), Megatron-Core's all-to-all dispatcher's collective; combine is the reverse
exchange and a scatter-add). Each dispatch and combine timing covers the whole operator (count
exchange and permutations included), ``warmup`` untimed then ``iters`` timed calls with one
device sync at the end, on the host clock (as ``aihpc bench comm``). The dispatch carries the
gate weights; the timed combine is unweighted, as DeepEP's tuning loop times it (the MoE layer
applies the weights to the expert outputs).

Check (``#wrong``, zero tolerance): on integer-valued tokens, every rank rebuilds every rank's
routing from the seed and compares the rows it received, in the operator's documented order,
and the unweighted combine of them, which must be the token times its number of experts.

Calibration: each measured size of ``ours`` (dispatch and combine) is also written as an
``all_to_all`` point with nccl-tests semantics (size = bytes one rank sends, its own share
included; ``aihpc calibrate`` fits latency and busbw over the sizes).
"""

# ruff: noqa: UP031  (printf-style on purpose: nccl-tests' table formats)

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from aihpc.bench.collectives import DTYPE_BYTES, DTYPE_NAMES, busbw_factor, float_str
from aihpc.bench.comm import TORCH_DTYPES
from aihpc.bench.dist import DistContext, init_distributed, run_facts
from aihpc.comm import MoEDispatcher, build_ep_groups
from aihpc.runspec.errors import SpecError

__all__ = [
    "IMPLS",
    "MoEBenchConfig",
    "MoEResult",
    "calibration_points",
    "format_footer",
    "format_header",
    "format_row",
    "moe_results_json",
    "run_in_new_group",
    "run_moe_bench",
    "validate_moe_config",
]

IMPLS = ("ours", "ours_hier", "a2a_single")


@dataclass(frozen=True)
class MoEBenchConfig:
    tokens: tuple[int, ...] = (4096,)  # per rank
    hidden: int = 7168
    topk: int = 8
    experts: int = 256
    topk_groups: int | None = None  # nodes a token may use; None: DeepEP's min(nodes, 4)
    dtype: str = "bfloat16"
    impls: tuple[str, ...] = IMPLS
    iters: int = 20
    warmup: int = 2
    check: bool = True
    ranks_per_node: int | None = None  # None: from the hostnames; set it to emulate nodes
    seed: int = 0
    corrupt_rank: int | None = None  # fault injection: this rank spoils one received element


@dataclass(frozen=True)
class Phase:
    time_us: float
    GBps: float  # DeepEP's per-rank figure: received (dispatch) / sent (combine) token bytes
    xnode_GBps: float  # token bytes sent across nodes per second


@dataclass(frozen=True)
class MoEResult:
    impl: str
    tokens: int
    hidden: int
    topk: int
    experts: int
    topk_groups: int
    num_ranks: int
    ranks_per_node: int
    dtype: str
    recv_bytes: float  # mean over ranks
    xnode_bytes: float  # mean over ranks
    rdma_bytes: float  # hierarchical only: DeepEP's internode bytes (0 otherwise)
    dispatch: Phase
    combine: Phase
    wrong: int | None

    @property
    def tier(self) -> str:
        return "scale_up" if self.ranks_per_node >= self.num_ranks else "scale_out"

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["tier"] = self.tier
        for phase in ("dispatch", "combine"):
            p = getattr(self, phase)
            out[phase]["rdma_GBps"] = self.rdma_bytes / 1e3 / p.time_us if self.rdma_bytes else 0
        return out


def validate_moe_config(cfg: MoEBenchConfig, world_size: int | None = None) -> MoEBenchConfig:
    """Raise SpecError naming the flag for anything the run cannot do; normalise names."""
    if cfg.dtype not in DTYPE_NAMES or DTYPE_NAMES[cfg.dtype] in ("int32", "int64"):
        raise SpecError("-d/--datatype", cfg.dtype, "allowed: bfloat16 | half | float | double")
    for impl in cfg.impls:
        if impl not in IMPLS:
            raise SpecError("--impl", impl, "allowed: " + " | ".join(IMPLS))
    if not cfg.tokens or any(t < 1 for t in cfg.tokens):
        raise SpecError("--tokens", list(cfg.tokens), "token counts must be >= 1")
    for flag, value in (("--hidden", cfg.hidden), ("--topk", cfg.topk), ("-n/--iters", cfg.iters)):
        if value < 1:
            raise SpecError(flag, value, "must be >= 1")
    if cfg.warmup < 0:
        raise SpecError("-w/--warmup-iters", cfg.warmup, "must be >= 0")
    if cfg.topk_groups is not None and cfg.topk_groups < 1:
        raise SpecError("--topk-groups", cfg.topk_groups, "must be >= 1")
    if cfg.ranks_per_node is not None and cfg.ranks_per_node < 1:
        raise SpecError("--ranks-per-node", cfg.ranks_per_node, "must be >= 1")
    if world_size is not None:
        experts = cfg.experts // world_size * world_size
        if experts < cfg.topk:
            raise SpecError(
                "--experts",
                cfg.experts,
                f">= --topk {cfg.topk} after rounding to {world_size} ranks",
            )
        rpn = cfg.ranks_per_node
        if rpn is not None and world_size % rpn:
            raise SpecError("--ranks-per-node", rpn, f"must divide the world size {world_size}")
    return MoEBenchConfig(**{**asdict(cfg), "dtype": DTYPE_NAMES[cfg.dtype]})


def _routing(
    seed: int, rank: int, tokens: int, experts: int, topk: int, nodes: int, groups: int, device: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's top-k experts and gate weights, DeepEP's way (see the module docstring)."""
    g = torch.Generator(device="cpu").manual_seed(seed * 100_003 + rank)
    scores = torch.randn((tokens, experts), generator=g).abs() + 1
    if nodes > 1 and groups < nodes:
        best = scores.view(tokens, nodes, -1).amax(dim=-1).topk(groups, dim=-1).indices
        allowed = torch.zeros((tokens, nodes), dtype=torch.bool).scatter_(1, best, True)
        scores = scores.masked_fill(~allowed.repeat_interleave(experts // nodes, dim=1), 0)
    idx = scores.topk(topk, dim=-1).indices
    weights = torch.rand((tokens, topk), generator=g)
    return idx.to(device), weights.to(device)


def _check_tokens(rank: int, tokens: int, hidden: int, dtype: Any, device: Any) -> torch.Tensor:
    """Integer-valued tokens in [-7, 7] (exact in bf16, and 7 * top-k stays exact when summed)."""
    t = torch.arange(tokens, device=device).unsqueeze(1)
    c = torch.arange(hidden, device=device).unsqueeze(0)
    return ((rank * 31 + t * 7 + c * 3) % 15 - 7).to(dtype)


class _PlainA2A:
    """Dispatch / combine on torch's all_to_all_single: one copy per (token, expert)."""

    def __init__(self, experts: int, group: Any) -> None:
        self.group, self.ranks = group, dist.get_world_size(group)
        self.per_rank = experts // self.ranks

    def dispatch(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> dict[str, Any]:
        k = idx.shape[1]
        order = torch.argsort(idx.reshape(-1), stable=True)  # by expert, then token
        dest = torch.div(idx.reshape(-1)[order], self.per_rank, rounding_mode="floor")
        send = torch.bincount(dest, minlength=self.ranks)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        counts = torch.stack([send, recv]).tolist()
        tok = torch.div(order, k, rounding_mode="floor")
        out = x.new_empty((sum(counts[1]), x.shape[1]))
        dist.all_to_all_single(out, x.index_select(0, tok), counts[1], counts[0], group=self.group)
        return {"x": out, "tok": tok, "w": w.reshape(-1)[order], "counts": counts, "n": len(x)}

    def combine(self, y: torch.Tensor, h: dict[str, Any], weighted: bool = True) -> torch.Tensor:
        back = y.new_empty((len(h["tok"]), y.shape[1]))
        dist.all_to_all_single(back, y, h["counts"][0], h["counts"][1], group=self.group)
        if weighted:
            back = back * h["w"].unsqueeze(1).to(back.dtype)
        return y.new_zeros((h["n"], y.shape[1])).index_add_(0, h["tok"], back)


@dataclass
class _Setup:
    """What one rank needs for every size: groups, node layout, the operators."""

    ctx: DistContext
    cfg: MoEBenchConfig
    experts: int
    rpn: int  # ranks per node
    topk_groups: int
    impls: dict[str, Any]

    @property
    def nodes(self) -> int:
        return self.ctx.world_size // self.rpn

    def routing(self, rank: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        args = (c.seed, rank, tokens, self.experts, c.topk, self.nodes, self.topk_groups)
        return _routing(*args, self.ctx.device)


def _setup(ctx: DistContext, cfg: MoEBenchConfig) -> _Setup:
    world = ctx.world_size
    hosts = ctx.hostnames
    rpn = cfg.ranks_per_node or (hosts.count(hosts[0]) if hosts else world)
    nodes = world // rpn
    experts = cfg.experts // world * world
    groups = cfg.topk_groups or min(nodes, 4)
    if nodes > 1 and groups * (experts // nodes) < cfg.topk:
        raise SpecError(
            "--topk-groups", groups, f"its nodes hold fewer than --topk {cfg.topk} experts"
        )
    impls: dict[str, Any] = {}
    for impl in cfg.impls:
        if impl == "ours":
            impls[impl] = MoEDispatcher(experts, build_ep_groups(world))
        elif impl == "ours_hier" and nodes > 1:  # one node: nothing to make hierarchical
            impls[impl] = MoEDispatcher(experts, build_ep_groups(world, rpn))
        elif impl == "a2a_single":
            impls[impl] = _PlainA2A(experts, None)
    return _Setup(ctx, cfg, experts, rpn, min(groups, nodes), impls)


def _run_impl(s: _Setup, impl: str, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor):
    """(dispatch result, combine callable) of one implementation."""
    op = s.impls[impl]
    if impl == "a2a_single":
        h = op.dispatch(x, idx, w)
        return h, lambda weighted=True: op.combine(h["x"], h, weighted)
    d = op.dispatch(x, idx, w)
    return d, lambda weighted=True: op.combine(d.x, d.handle, d.weights if weighted else None)


def _traffic(s: _Setup, impl: str, res: Any, hidden_bytes: int) -> tuple[float, float, float]:
    """(received, cross-node, DeepEP-RDMA) token bytes of this rank for one dispatch."""
    me = s.ctx.rank // s.rpn
    if impl == "a2a_single":
        send, recv = res["counts"]
        cross = sum(c for p, c in enumerate(send) if p // s.rpn != me)
        return sum(recv) * hidden_bytes, cross * hidden_bytes, 0.0
    first = res.handle.routes[0] if len(res.handle.routes) > 1 else None
    if first is None:
        return res.recv_rows * hidden_bytes, 0.0, 0.0
    # the first route's peers are ranks (flat) or nodes (hierarchical)
    node_of = (lambda p: p) if impl == "ours_hier" else (lambda p: p // s.rpn)
    cross = sum(c for p, c in enumerate(first.send_counts) if node_of(p) != me)
    return res.recv_rows * hidden_bytes, cross * hidden_bytes, res.inter_node_rows * hidden_bytes


def _time(fn: Callable[[], Any], s: _Setup) -> float:
    for _ in range(s.cfg.warmup):
        fn()
    s.ctx.sync()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(s.cfg.iters):
        fn()
    s.ctx.sync()
    return (time.perf_counter() - t0) / s.cfg.iters


def _expected_rows(s: _Setup, impl: str, tokens: int, dtype: Any) -> torch.Tensor:
    """The rows this rank must receive, in the implementation's order, from every rank's
    regenerated routing: ours expert-major then source rank; a2a_single source-major then
    expert (then token in both)."""
    cfg, dev, per_rank = s.cfg, s.ctx.device, s.experts // s.ctx.world_size
    blocks: dict[tuple[int, int], torch.Tensor] = {}
    for src in range(s.ctx.world_size):
        idx, _ = s.routing(src, tokens)
        x = _check_tokens(src, tokens, cfg.hidden, dtype, dev)
        for le in range(per_rank):
            blocks[(le, src)] = x[(idx == s.ctx.rank * per_rank + le).any(dim=1)]
    keys = sorted(blocks, key=(lambda k: (k[1], k[0])) if impl == "a2a_single" else None)
    return torch.cat([blocks[k] for k in keys])


def _check(s: _Setup, impl: str, tokens: int, dtype: Any) -> int:
    """Wrong elements of this rank: dispatched rows, then the unweighted combine (token x k)."""
    cfg, dev = s.cfg, s.ctx.device
    x = _check_tokens(s.ctx.rank, tokens, cfg.hidden, dtype, dev)
    idx, w = _routing(
        cfg.seed, s.ctx.rank, tokens, s.experts, cfg.topk, s.nodes, s.topk_groups, dev
    )
    res, combine = _run_impl(s, impl, x, idx, w)
    got = res["x"] if impl == "a2a_single" else res.x
    if cfg.corrupt_rank == s.ctx.rank and got.numel():
        got.view(-1)[got.numel() // 2] += 1  # the deliberate fault the tests look for
    want = _expected_rows(s, impl, tokens, dtype)
    wrong = int((got != want).sum()) if got.shape == want.shape else max(got.numel(), 1)
    back = combine(weighted=False)
    return wrong + int((back != x * cfg.topk).sum())


def _measure(s: _Setup, impl: str, tokens: int) -> MoEResult:
    cfg, ctx = s.cfg, s.ctx
    dtype = TORCH_DTYPES[cfg.dtype]
    g = torch.Generator(device="cpu").manual_seed(cfg.seed + ctx.rank)
    x = torch.randn((tokens, cfg.hidden), generator=g).to(device=ctx.device, dtype=dtype)
    idx, w = s.routing(ctx.rank, tokens)
    res, combine = _run_impl(s, impl, x, idx, w)
    recv, cross, rdma = _traffic(s, impl, res, cfg.hidden * DTYPE_BYTES[cfg.dtype])
    op = s.impls[impl]
    t_dispatch = _time(lambda: op.dispatch(x, idx, w), s)
    t_combine = _time(lambda: combine(weighted=False), s)  # DeepEP times it unweighted
    wrong = _check(s, impl, tokens, dtype) if cfg.check else 0
    stats = torch.tensor(
        [t_dispatch, t_combine, recv, cross, rdma, wrong], dtype=torch.float64, device=ctx.device
    )
    dist.all_reduce(stats)
    n = ctx.world_size
    t_d, t_c, recv, cross, rdma = (float(v) / n for v in stats[:5])
    return MoEResult(
        impl,
        tokens,
        cfg.hidden,
        cfg.topk,
        s.experts,
        s.topk_groups,
        n,
        s.rpn,
        cfg.dtype,
        recv,
        cross,
        rdma,
        Phase(t_d * 1e6, recv / 1e9 / t_d, cross / 1e9 / t_d),
        Phase(t_c * 1e6, recv / 1e9 / t_c, cross / 1e9 / t_c),
        int(stats[5]) if cfg.check else None,
    )


def run_moe_bench(
    ctx: DistContext,
    cfg: MoEBenchConfig,
    on_result: Callable[[MoEResult], None] | None = None,
) -> list[MoEResult]:
    """Every token count and implementation on every rank; all ranks return the same results."""
    cfg = validate_moe_config(cfg, ctx.world_size)
    s = _setup(ctx, cfg)
    results = []
    with torch.no_grad():
        for tokens in cfg.tokens:
            for impl in s.impls:
                r = _measure(s, impl, tokens)
                results.append(r)
                if on_result:
                    on_result(r)
    return results


def run_in_new_group(cfg: MoEBenchConfig, timeout_s: float = 300.0) -> list[MoEResult]:
    """Join (or create) the process group, run, tear down (for ``launch_local`` workers)."""
    with init_distributed(timeout_s) as ctx:
        return run_moe_bench(ctx, cfg)


def calibration_points(results: list[MoEResult], impl: str = "ours") -> list[dict[str, Any]]:
    """``all_to_all`` points, nccl-tests semantics, from one implementation's dispatch and
    combine times: size = token bytes one rank sends (= receives, on average), own share
    included; ``aihpc calibrate`` reads them from the ``calibration`` key."""
    points = []
    for r in results:
        if r.impl != impl or r.recv_bytes <= 0:
            continue
        for phase in ("dispatch", "combine"):
            points.append(
                {
                    "collective": "all_to_all",
                    "tier": r.tier,
                    "num_ranks": r.num_ranks,
                    "ranks_per_domain": min(r.ranks_per_node, r.num_ranks),
                    "size_bytes": r.recv_bytes,
                    "time_us": getattr(r, phase).time_us,
                    "busbw_GBps": r.recv_bytes
                    / 1e3
                    / getattr(r, phase).time_us
                    * busbw_factor("all_to_all", r.num_ranks),
                    "source": f"aihpc bench moe: {impl} {phase}, {r.tokens} tokens per rank",
                }
            )
    return points


def moe_results_json(results: list[MoEResult], ctx: DistContext, cfg: MoEBenchConfig) -> dict:
    return {
        "benchmark": "moe",
        **run_facts(ctx),
        "iters": cfg.iters,
        "warmup": cfg.warmup,
        "seed": cfg.seed,
        "results": [r.to_json() for r in results],
        "wrong_rows": sum(1 for r in results if r.wrong),
        "calibration": calibration_points(results),
    }


# -- the nccl-tests-style table ----------------------------------------------------------------

_COLUMNS = ("tokens", "impl", "recv", "xnode", "time", "GB/s", "xnode", "time", "GB/s", "xnode")
_UNITS = ("", "", "(B)", "(B)", "(us)", "", "GB/s", "(us)", "", "GB/s")
_ROW = "  %10s  %10s  %10s  %10s  %9s  %6s  %6s  %9s  %6s  %6s  %6s"


def format_header(results_cfg: MoEBenchConfig, first: MoEResult, devices: list[str]) -> str:
    """Parameters, devices and the two-level column header (nccl-tests v2.19's layout)."""
    nodes = max(1, first.num_ranks // first.ranks_per_node)
    return "\n".join(
        [
            "# MoE dispatch/combine test starting: aihpc bench moe (DeepEP's setting and GB/s)",
            f"# nRanks {first.num_ranks} nNodes {nodes} ranksPerNode {first.ranks_per_node}"
            f" experts {first.experts} topk {first.topk} topkGroups {first.topk_groups}"
            f" hidden {first.hidden} type {first.dtype}",
            f"# warmup iters: {results_cfg.warmup} iters: {results_cfg.iters}"
            f" validation: {int(results_cfg.check)} seed: {results_cfg.seed}",
            "#",
            "# Using devices",
            *devices,
            "#",
            # the phase names centred over their three columns (nccl-tests' out-of-place line)
            "#" + " " * 47 + "dispatch".center(25) + "  " + "combine".center(25),
            "#" + _ROW[1:] % (*_COLUMNS, "#wrong"),
            "#" + _ROW[1:] % (*_UNITS, ""),
        ]
    )


def format_row(r: MoEResult) -> str:
    def f(v: float, w: int) -> str:
        return float_str(v, w)

    return _ROW % (
        r.tokens,
        r.impl,
        "%.0f" % r.recv_bytes,
        "%.0f" % r.xnode_bytes,
        f(r.dispatch.time_us, 9),
        f(r.dispatch.GBps, 6),
        f(r.dispatch.xnode_GBps, 6),
        f(r.combine.time_us, 9),
        f(r.combine.GBps, 6),
        f(r.combine.xnode_GBps, 6),
        "N/A" if r.wrong is None else str(r.wrong),
    )


def format_footer(results: list[MoEResult]) -> str:
    bad = sum(1 for r in results if r.wrong)
    lines = ["# %-20s : %d %s" % ("Out of bounds values", bad, "FAILED" if bad else "OK")]
    for impl in dict.fromkeys(r.impl for r in results):
        rows = [r for r in results if r.impl == impl]
        d = sum(r.dispatch.GBps for r in rows) / len(rows)
        c = sum(r.combine.GBps for r in rows) / len(rows)
        lines.append("# %-20s : dispatch %g  combine %g GB/s" % (f"Avg {impl}", d, c))
    return "\n".join([*lines, "#", "# MoE dispatch/combine test concluded"])
