"""The software that runs an MoE layer (``training.moe_stack``) and what its dispatch costs.

Each stack (``data/moe_stacks.toml``) names its dispatcher, the kernels that move the tokens,
how far those kernels reach over NVLink, and its host costs; the kernels' published bandwidths
are in ``data/moe_a2a_kernels.csv`` (DeepEP's normal kernels and HybridEP, measured by their
authors at DeepSeek-V3's shape: 4,096 tokens of hidden 7,168, top-8, one row per source).

A kernel's figure is an *algorithm bandwidth*, DeepEP's convention (tests/test_intranode.py,
test_internode.py): over NVLink, the bytes of the rows a rank receives, one row per (token,
destination rank), its own rows included; over RDMA, one row per (token, destination NVLink
group), its own group included. The price of one dispatch or combine is those bytes over the
kernel's figure, scaled from the part it was measured on to the cluster's by the ratio of their
link bandwidths (a kernel keeps its share of the link), interpolated in log2(ranks) and in the
SMs the stack gives the kernel, clamped outside the measured range. The NVLink and RDMA phases
run at once (both kernels pipeline them), so the slower one sets the time.

Beyond the measured parts (an A100, an MI300X, a custom part without a catalog id) and for NCCL
stacks, the transfer is priced as before the fact existed: the link efficiencies of every other
collective (``comm.moe_all_to_all_time_s``), on the NVLink reach of the stack.
"""

from __future__ import annotations

import csv
import io
import itertools
import math
import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources

from aihpc.runspec.training import TrainingSpec

__all__ = ["MoEStack", "kernel_GBps", "ranks_touched", "stack_of", "stacks"]


@dataclass(frozen=True)
class MoEStack:
    id: str
    dispatcher: str  # alltoall | hierarchical | allgather
    kernel: str  # nccl | deepep | hybridep
    nvlink_reach: int  # 0: the whole scale-up domain
    host: str  # moe_host.py's dispatcher key, or "none"
    sms: int = 0
    capacity_padding: bool = False
    einsum_dispatch: bool = False
    source: str = ""


@cache
def stacks() -> dict[str, MoEStack]:
    text = resources.files("aihpc.perf.step").joinpath("data/moe_stacks.toml").read_text()
    return {k: MoEStack(id=k, **v) for k, v in tomllib.loads(text).items()}


def stack_of(training: TrainingSpec) -> MoEStack | None:
    """The run's stack, or None when ``moe_stack`` is unknown."""
    return stacks().get(training.moe_stack)


@cache
def _kernel_rows() -> tuple[dict[str, str], ...]:
    text = resources.files("aihpc.perf.step").joinpath("data/moe_a2a_kernels.csv").read_text()
    return tuple(csv.DictReader(io.StringIO(text)))


def _interp(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through ``points`` (sorted by x), clamped at both ends."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def kernel_GBps(
    kernel: str, gpu_id: str, tier: str, ranks: int, sms: int, column: str, link_GBps: float
) -> float | None:
    """The kernel's algorithm bandwidth on this part's link (GB/s), or None where it has no
    published figure for this part and tier. ``column``: dispatch_fp8, dispatch_bf16 or
    combine (a dispatch dtype without its own figure takes the other dtype's)."""
    rows = [
        r
        for r in _kernel_rows()
        if r["kernel"] == kernel and r["tier"] == tier and gpu_id in r["parts"].split()
    ]
    if not rows:
        return None
    cols = [column + "_GBps"]
    if column.startswith("dispatch"):
        other = "dispatch_bf16" if column == "dispatch_fp8" else "dispatch_fp8"
        cols.append(other + "_GBps")
    col = next((c for c in cols if any(r[c] for r in rows)), None)
    if col is None:
        return None
    by_sms: dict[int, list[tuple[float, float]]] = {}
    for r in rows:
        if r[col]:  # the share of the measured part's link the kernel reached
            share = float(r[col]) / float(r["link_GBps"])
            by_sms.setdefault(int(r["sms"]), []).append((math.log2(int(r["ranks"])), share))
    at_sms = sorted((s, _interp(sorted(p), math.log2(max(ranks, 2)))) for s, p in by_sms.items())
    return _interp(at_sms, sms or at_sms[0][0]) * link_GBps


def ranks_touched(ranks: int, top_k: int, groups: int, group_limit: float) -> tuple[float, float]:
    """(NVLink groups, ranks) one token's top-k experts lie in, on average, its own included:
    experts spread evenly over ``ranks`` ranks in ``groups`` NVLink groups, picked uniformly
    (forced balance), at most ``group_limit`` groups per token (node-limited routing; 0: no
    limit). k picks over D groups touch D (1 - (1 - 1/D)^k) of them; the picks falling in one
    group, k / D' each, touch r (1 - (1 - 1/r)^(k/D')) of its r ranks."""
    per_group = ranks / max(groups, 1)
    d = groups * (1 - (1 - 1 / groups) ** top_k) if groups > 1 else 1.0
    if group_limit:
        d = min(d, group_limit)
    in_group = per_group * (1 - (1 - 1 / per_group) ** (top_k / d)) if per_group > 1 else 1.0
    return d, d * in_group
