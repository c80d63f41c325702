"""What ``aihpc bench comm`` is asked to do, checked without torch and before any process starts.

A flag the run cannot honour (an unknown collective, ``--group inter`` on one node, a root rank
outside the job) is answered in the command's own process, in well under a second, instead of by
every spawned worker after torch and the process group are up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from aihpc.bench.collectives import COLLECTIVES, DTYPE_NAMES, REDOPS
from aihpc.runspec.errors import SpecError

__all__ = ["GROUPS", "CommConfig", "group_layout", "validate_comm_config"]

GROUPS = ("world", "intra", "inter")


@dataclass(frozen=True)
class CommConfig:
    collectives: tuple[str, ...] = COLLECTIVES
    sizes: tuple[int, ...] = (1 << 20,)
    iters: int = 20
    warmup: int = 1
    dtype: str = "float"
    op: str = "sum"
    check: bool = True
    root: int = 0
    group: str = "world"  # world | intra (inside a node) | inter (same local rank across nodes)
    ranks_per_node: int | None = None  # None: from the hostnames; set it to emulate nodes
    corrupt_rank: int | None = None  # fault injection: this rank spoils one checked element


def validate_comm_config(cfg: CommConfig, world_size: int | None = None) -> CommConfig:
    """Raise SpecError naming the flag for anything the run cannot do; normalise names."""
    for c in cfg.collectives:
        if c not in COLLECTIVES:
            raise SpecError("--collective", c, "allowed: " + " | ".join(COLLECTIVES))
    if cfg.dtype not in DTYPE_NAMES:
        raise SpecError("-d/--datatype", cfg.dtype, "allowed: " + " | ".join(DTYPE_NAMES))
    if cfg.op not in REDOPS:
        raise SpecError("--op", cfg.op, "allowed: " + " | ".join(REDOPS))
    dtype = DTYPE_NAMES[cfg.dtype]
    if cfg.op == "avg" and dtype in ("int32", "int64"):
        raise SpecError("--op", "avg", "needs a floating-point -d/--datatype")
    if cfg.iters < 1:
        raise SpecError("-n/--iters", cfg.iters, "must be >= 1")
    if cfg.warmup < 0:
        raise SpecError("-w/--warmup-iters", cfg.warmup, "must be >= 0")
    if cfg.group not in GROUPS:
        raise SpecError("--group", cfg.group, "allowed: " + " | ".join(GROUPS))
    if not cfg.sizes or any(s <= 0 for s in cfg.sizes):
        raise SpecError("-b/--minbytes", list(cfg.sizes), "sizes must be > 0")
    if cfg.ranks_per_node is not None and cfg.ranks_per_node < 1:
        raise SpecError("--ranks-per-node", cfg.ranks_per_node, "must be >= 1")
    if world_size is not None:
        rpn = cfg.ranks_per_node
        if rpn is not None and world_size % rpn:
            raise SpecError("--ranks-per-node", rpn, f"must divide the world size {world_size}")
        if "send_recv" in cfg.collectives and world_size < 2:
            raise SpecError("--collective", "send_recv", "needs at least 2 ranks")
        if not 0 <= cfg.root < world_size:
            raise SpecError("-r/--root", cfg.root, f"allowed: 0 to {world_size - 1}")
    return CommConfig(
        **{
            **asdict(cfg),
            "dtype": dtype,
            "collectives": tuple(cfg.collectives),
            "sizes": tuple(cfg.sizes),
        }
    )


def group_layout(cfg: CommConfig, node_of: Sequence[int]) -> tuple[list[list[int]], str, int]:
    """The groups ``cfg.group`` splits the job into, given each rank's node index.

    Returns (the groups' global ranks, the tier they measure, group members per node). Every
    rank must create every group in the same order (torch.distributed's rule), so all are listed.
    """
    world_size = len(node_of)
    num_nodes = len(set(node_of))
    if cfg.group == "world":
        tier = "scale_up" if num_nodes == 1 else "scale_out"
        return [list(range(world_size))], tier, world_size // num_nodes
    nodes = [[r for r in range(world_size) if node_of[r] == n] for n in sorted(set(node_of))]
    if len({len(n) for n in nodes}) != 1:
        raise SpecError("--group", cfg.group, "needs the same number of ranks on every node")
    if cfg.group == "intra":
        lists, tier = nodes, "scale_up"
    else:
        if num_nodes < 2:
            raise SpecError(
                "--group",
                "inter",
                "needs at least 2 nodes; this job has 1 (use --ranks-per-node to emulate nodes "
                "on one host)",
            )
        lists, tier = [[n[i] for n in nodes] for i in range(len(nodes[0]))], "scale_out"
    if "send_recv" in cfg.collectives and len(lists[0]) < 2:
        raise SpecError("--group", cfg.group, "send_recv needs at least 2 ranks per group")
    return lists, tier, (len(lists[0]) if cfg.group == "intra" else 1)
