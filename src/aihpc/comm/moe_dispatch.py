"""MoE token dispatch and combine over an expert-parallel group: flat and hierarchical.

Layout: ``num_experts`` experts over ``ep`` ranks, ``num_experts / ep`` consecutive experts per
rank (expert e lives on EP rank ``e // experts_per_rank``). Each rank routes its own tokens.

**dispatch(x, topk_idx, topk_weights)** takes a rank's tokens (n, h), their top-k experts (n, k)
(-1: no expert, e.g. a dropped slot) and gate weights (n, k), and returns the tokens this rank's
experts must process, grouped by local expert (expert-major; inside an expert by source rank,
then by token), one row per (token, local expert), with the matching weights and the number of
tokens per local expert. **combine(y, handle, weights)** takes the experts' outputs in that
order, multiplies them by the weights and sums them back into (n, h) at the source ranks:
``out[t] = sum_j w[t, j] * expert_{idx[t, j]}(x[t])``.

Flat (one stage over the EP group): a token goes once to every rank holding one of its experts;
that rank expands it to its local experts. Hierarchical (``ranks_per_node`` set; DeepEP's normal
internode kernels, csrc/kernels/internode.cu: the dispatch's RDMA sender → RDMA-and-NVL forwarder
→ NVL receiver, the combine's NVL sender → NVL-and-RDMA forwarder → RDMA receiver): the dispatch
first crosses nodes, once per destination *node*, to the rank with the sender's local index on
that node (its "rail" peer), which then forwards inside its node, once per destination rank; the
combine goes the other way, reducing inside the node first and crossing nodes once per token and
node. Inter-node bytes fall from one copy per (token, remote rank) to one per (token, remote node).

Both paths deliver the same rows in the same order (tokens carry their source rank), so expert
inputs are bitwise identical; only the association of the final cross-rank sum differs.

Every collective is a ``torch.distributed`` call on the given groups, so the same code runs on
gloo (CPU tests) and NCCL (GPUs). Counts cost one host sync per stage, as in Megatron-Core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from aihpc.comm.route import Route, combine_stage, dispatch_stage, plan_route

__all__ = ["DispatchHandle", "Dispatched", "EPGroups", "MoEDispatcher", "build_ep_groups"]


@dataclass(frozen=True)
class EPGroups:
    """The process groups of one rank's expert-parallel group (``build_ep_groups`` makes them;
    from a DeviceMesh: ``EPGroups(mesh["ep"].get_group(), expert_dp=mesh["edp"].get_group())``).

    ``group``: all EP ranks (None: this process alone). ``intra`` / ``inter``: for the
    hierarchical path, the EP ranks on this rank's node, and the EP ranks with this rank's local
    index on every node; EP rank = node * ranks_per_node + local index. ``expert_dp``: the ranks
    holding the same experts in other EP groups (gradient averaging of expert weights).
    """

    group: Any = None
    ranks_per_node: int | None = None
    intra: Any = None
    inter: Any = None
    expert_dp: Any = None

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group) if self.group is not None else 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if self.group is not None else 0

    @property
    def hierarchical(self) -> bool:
        return self.inter is not None and self.intra is not None

    @property
    def device_type(self) -> str:
        if self.group is None:
            return "cpu"
        return "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"


def build_ep_groups(ep_size: int, ranks_per_node: int | None = None) -> EPGroups:
    """Create the EP groups of the whole job (collective: every rank calls it, same arguments).

    Ranks are laid out expert-data-parallel-major: EP group g holds ranks [g*ep, (g+1)*ep), and
    ``ranks_per_node`` consecutive ranks share a node (set it to emulate nodes on one host). With
    ``ranks_per_node`` below ``ep_size`` the intra-node and rail groups of the hierarchical path
    are created too.
    """
    world, me = dist.get_world_size(), dist.get_rank()
    if ep_size < 1 or world % ep_size:
        raise ValueError(f"ep_size {ep_size} must divide the world size {world}")
    rpn = ranks_per_node
    if rpn is not None and (rpn < 1 or ep_size % rpn):
        raise ValueError(f"ranks_per_node {rpn} must divide ep_size {ep_size}")
    groups = [list(range(g * ep_size, (g + 1) * ep_size)) for g in range(world // ep_size)]
    # every rank creates every group, in one order (torch.distributed's rule for new_group)
    ep_pgs = [dist.new_group(r) if ep_size < world else dist.group.WORLD for r in groups]
    edp_lists = [[g[i] for g in groups] for i in range(ep_size)]
    edp_pgs = [dist.new_group(r) for r in edp_lists]
    mine = me // ep_size
    intra = inter = None
    if rpn is not None and rpn < ep_size:
        for g in groups:
            nodes = [g[i : i + rpn] for i in range(0, ep_size, rpn)]
            rails = [[n[j] for n in nodes] for j in range(rpn)]
            for ranks in nodes + rails:
                pg = dist.new_group(ranks)
                if me in ranks and ranks in nodes:
                    intra = pg
                elif me in ranks:
                    inter = pg
    return EPGroups(ep_pgs[mine], rpn, intra, inter, edp_pgs[me % ep_size])


@dataclass
class DispatchHandle:
    """What combine needs: the routes of the dispatch, last one local (rows → expert pairs)."""

    routes: list[Route]
    dtype: torch.dtype


@dataclass
class Dispatched:
    x: torch.Tensor  # (m, h): one row per (token, local expert), grouped by local expert
    weights: torch.Tensor | None  # (m,) gate weight of each row
    tokens_per_expert: list[int]  # (experts per rank,), known from the count exchange
    handle: DispatchHandle
    received: int | torch.Tensor  # see recv_rows
    inter_node_rows: int  # hierarchical: token rows this rank sent across nodes (0 if flat)

    @property
    def recv_rows(self) -> int:
        """Token rows this rank received, one per (token, rank): DeepEP's ``recv_x``."""
        return int(self.received)


class MoEDispatcher:
    """Our dispatch / combine operators for one EP group (see the module docstring)."""

    def __init__(self, num_experts: int, groups: EPGroups | None = None) -> None:
        self.groups = groups or EPGroups()
        self.ep, self.rank = self.groups.size, self.groups.rank
        if num_experts < 1 or num_experts % self.ep:
            raise ValueError(f"num_experts {num_experts} must be a multiple of EP size {self.ep}")
        self.num_experts = num_experts
        self.experts_per_rank = num_experts // self.ep
        rpn = self.groups.ranks_per_node if self.groups.hierarchical else None
        self.rpn = rpn or self.ep
        self.node = self.rank // self.rpn
        if self.groups.hierarchical:  # EP rank = node * ranks_per_node + local index
            g = self.groups
            sizes = (dist.get_world_size(g.intra), dist.get_world_size(g.inter))
            places = (dist.get_rank(g.intra), dist.get_rank(g.inter))
            want = ((self.rpn, self.ep // self.rpn), (self.rank % self.rpn, self.node))
            if (sizes, places) != want:
                raise ValueError(
                    f"intra / inter groups of sizes {sizes} at {places} do not lay out EP rank "
                    f"{self.rank} of {self.ep} as node * {self.rpn} + local index"
                )

    def _owner(self, idx: torch.Tensor) -> torch.Tensor:
        """EP rank of each expert id (garbage for -1; callers mask)."""
        return torch.div(idx, self.experts_per_rank, rounding_mode="floor")

    def _level(self, idx: torch.Tensor, level: str) -> tuple[torch.Tensor, int, int, Any, int]:
        """(peer of each slot or -1, first expert id behind peer 0, experts per peer, group,
        peers) for one level: ``flat`` (to ranks), ``inter`` (to nodes) or ``intra`` (to the
        ranks of this node; slots whose expert is on another node are ignored)."""
        owner, per_rank, g = self._owner(idx), self.experts_per_rank, self.groups
        node = torch.div(owner, self.rpn, rounding_mode="floor")
        if level == "flat":
            dest, lo, width, group, peers = owner, 0, per_rank, g.group, self.ep
        elif level == "inter":
            dest, lo, width, group, peers = (
                node,
                0,
                self.rpn * per_rank,
                g.inter,
                self.ep // self.rpn,
            )
        else:
            idx = torch.where(node == self.node, idx, -1)
            lo = self.node * self.rpn * per_rank
            dest, width, group, peers = owner % self.rpn, per_rank, g.intra, self.rpn
        return torch.where(idx >= 0, dest, -1), lo, width, group, peers

    def _stage(
        self, x: torch.Tensor, w: torch.Tensor, meta: torch.Tensor, k: int, level: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Route]:
        """Route rows one level on; the count exchange carries tokens per expert behind each
        peer."""
        dest, lo, width, group, peers = self._level(meta[:, :k], level)
        # pairs per expert behind each peer, without a host sync (no bincount or mask)
        sent = dest >= 0
        slot_expert = torch.where(sent, meta[:, :k] - lo, 0).flatten()
        hist = torch.zeros(peers * width, dtype=torch.long, device=meta.device)
        hist.scatter_add_(0, slot_expert, sent.flatten().long())
        route = plan_route(dest, peers, group, expert_counts=hist.view(peers, width))
        x_out, w_out, meta_out = dispatch_stage(x, w, meta, route)
        return x_out, w_out, meta_out, route

    def _check(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor | None) -> None:
        n, k = idx.shape
        if x.shape[0] != n or (weights is not None and weights.shape != (n, k)):
            raise ValueError(
                f"x {tuple(x.shape)}, topk_idx {tuple(idx.shape)} and topk_weights "
                f"{None if weights is None else tuple(weights.shape)} disagree"
            )
        if idx.numel():
            lo, hi = torch.stack(torch.aminmax(idx)).tolist()  # one host sync
            if lo < -1 or hi >= self.num_experts:
                raise ValueError(
                    f"topk_idx holds {lo}..{hi}; allowed 0..{self.num_experts - 1} or -1"
                )

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor | None = None
    ) -> Dispatched:
        n, k = topk_idx.shape
        self._check(x, topk_idx, topk_weights)
        w = topk_weights if topk_weights is not None else x.new_empty((n, 0), dtype=torch.float32)
        src = torch.full((n, 1), self.rank, dtype=torch.int64, device=x.device)
        meta = torch.cat([topk_idx.to(torch.int64), src], dim=1)
        routes: list[Route] = []
        levels = ("inter", "intra") if self.groups.hierarchical else ("flat",)
        if self.groups.group is None:
            levels = ()  # one process holds every expert: no exchange, only the grouping below
        for level in levels:
            x, w, meta, route = self._stage(x, w, meta, k, level)
            routes.append(route)
        # group the received tokens by local expert, then by source rank, then by arrival
        idx = meta[:, :k]
        mine = (idx >= 0) & (self._owner(idx) == self.rank)
        local_e = torch.where(mine, idx - self.rank * self.experts_per_rank, -1)
        local = plan_route(
            local_e, self.experts_per_rank, None, row_key=meta[:, k], key_range=self.ep
        )
        x_pairs, _, _ = dispatch_stage(x, w[:, :0], meta[:, :0], local)
        weights = None
        if topk_weights is not None:
            # the gate weight of a (row, expert) pair: column send_cols of its row
            weights = w.reshape(-1).index_select(0, local.send_rows * k + local.send_cols)
        if routes:  # tokens per local expert: known from the count exchange
            counts = [sum(c) for c in zip(*routes[-1].recv_expert_counts or [], strict=True)]
            recv_rows: int | torch.Tensor = routes[-1].num_received
        else:
            counts = local.send_counts  # read in the local route's one host sync
            recv_rows = mine.any(dim=1).sum()  # read only if asked (no host sync per layer)
        inter_rows = routes[0].num_sent if self.groups.hierarchical and routes else 0
        routes.append(local)
        return Dispatched(
            x_pairs, weights, counts, DispatchHandle(routes, x.dtype), recv_rows, inter_rows
        )

    def combine(
        self, y: torch.Tensor, handle: DispatchHandle, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Weighted sum of the expert outputs ``y`` (m, h) back at the tokens' source ranks."""
        if weights is not None:  # in the weights' precision (float32 router), as Megatron-Core
            dtype = torch.promote_types(y.dtype, weights.dtype)
            y = y.to(dtype) * weights.to(dtype).unsqueeze(1)  # one dtype: the fast kernel
        local, *comm = reversed(handle.routes)
        out = combine_stage(y, local).to(handle.dtype)
        for route in comm:
            out = combine_stage(out, route)
        return out
