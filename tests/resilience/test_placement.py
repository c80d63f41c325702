"""Where the in-memory replicas live: never on the node of the rank they copy (two nodes or
more), every rank held exactly once, and a single node said to be unsafe against its loss."""

from __future__ import annotations

import pytest

from aihpc.resilience.placement import peer_placement


@pytest.mark.parametrize(
    "hosts",
    [
        ["a", "a", "b", "b"],
        ["a", "b", "a", "b"],  # ranks interleaved over nodes
        ["a"] * 4 + ["b"] * 4 + ["c"] * 4,
        ["a", "a", "a", "b"],  # uneven nodes
    ],
)
def test_holder_is_on_another_node(hosts):
    p = peer_placement(hosts)
    assert p.cross_node
    for rank, holder in enumerate(p.holder):
        assert hosts[holder] != hosts[rank], (rank, holder)
    # every rank's replica is somewhere, and held_for is the inverse of holder
    for rank in range(len(hosts)):
        assert rank in p.held_for(p.holder[rank])


def test_even_nodes_spread_the_replicas_one_per_rank():
    p = peer_placement(["a", "a", "b", "b"])
    assert p.holder == (2, 3, 0, 1)
    assert sorted(len(p.held_for(r)) for r in range(4)) == [1, 1, 1, 1]


def test_one_node_is_reported_and_uses_the_next_rank():
    p = peer_placement(["a", "a", "a"])
    assert not p.cross_node
    assert p.holder == (1, 2, 0)


def test_world_of_one_holds_nothing():
    p = peer_placement(["a"])
    assert p.holder == (0,) and p.held_for(0) == []
