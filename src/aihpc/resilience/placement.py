"""Where each rank's in-memory replica lives: on a rank of another node, so that losing one
node never takes a state and its replica together (Gemini, SOSP'23, section 4: replicas are
placed across machines so a machine failure leaves a copy). Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Placement", "peer_placement"]


@dataclass(frozen=True)
class Placement:
    """``holder[r]``: the rank that keeps rank r's replica; ``cross_node``: every holder is on
    another node than the rank it holds for (False with one node: a node loss takes both)."""

    holder: tuple[int, ...]
    cross_node: bool

    def held_for(self, rank: int) -> list[int]:
        """The ranks whose replicas ``rank`` keeps (none in a world of one)."""
        return [src for src, h in enumerate(self.holder) if h == rank and src != rank]


def peer_placement(hosts: list[str]) -> Placement:
    """The holder of each rank's replica, from the node (host name) of every rank.

    Ranks are grouped by node in rank order; rank r, the i-th rank of its node, is held by the
    i-th rank of the next node (cyclically; modulo that node's size when nodes differ in size),
    so a holder is never on the rank's own node when there are two nodes or more. With one node
    the holder is the next rank: a process death leaves the copy, a node loss does not.
    """
    world = len(hosts)
    nodes: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        nodes.setdefault(host, []).append(rank)
    order = list(nodes)
    if len(order) < 2:
        return Placement(tuple((r + 1) % world for r in range(world)), cross_node=False)
    holder = [0] * world
    for n, host in enumerate(order):
        nxt = nodes[order[(n + 1) % len(order)]]
        for i, rank in enumerate(nodes[host]):
            holder[rank] = nxt[i % len(nxt)]
    return Placement(tuple(holder), cross_node=True)
