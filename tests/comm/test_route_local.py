"""The operators' local parts on one process: packing, route planning, input checks."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from aihpc.comm import MoEDispatcher, plan_route  # noqa: E402
from aihpc.comm.route import _pack, _unpack  # noqa: E402


@pytest.mark.parametrize("rows", [0, 1, 5])
def test_packing_round_trips_every_dtype_bitwise(rows):
    parts = [
        torch.randn(rows, 7).to(torch.bfloat16),
        torch.randint(-(2**40), 2**40, (rows, 3)),
        torch.randn(rows, 2, dtype=torch.float64),
        torch.randn(rows, 0),
        torch.randn(rows),
    ]
    buf, layout = _pack(parts)
    assert buf.dtype == torch.int64 and buf.shape[0] == rows
    for a, b in zip(parts, _unpack(buf, layout), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_route_sends_a_row_once_per_peer_in_peer_then_row_order():
    dest = torch.tensor([[2, 0, 2], [1, -1, -1], [0, 0, 1], [-1, -1, -1]])
    r = plan_route(dest, num_peers=3)
    # (peer, row) order; row 0 goes to peers 0 and 2 once each although it names peer 2 twice
    assert r.send_rows.tolist() == [0, 2, 1, 2, 0]
    peers = dest[r.send_rows, r.send_cols].tolist()
    assert peers == [0, 0, 1, 1, 2]
    # a local permutation: copies per bucket, what each bucket receives
    assert r.send_counts == [2, 2, 1] == r.recv_counts
    # slots: a row's ordinal among its own destinations, ascending peer
    slot_of = {(int(row), j) for j, (_, rows) in enumerate(r.slot_index) for row in rows}
    assert slot_of == {(0, 0), (2, 0), (1, 0), (2, 1), (0, 1)}


def test_dispatch_refuses_expert_ids_out_of_range():
    disp = MoEDispatcher(4)
    with pytest.raises(ValueError, match="topk_idx holds"):
        disp.dispatch(torch.randn(2, 3), torch.tensor([[0, 4], [1, 2]]))
    with pytest.raises(ValueError, match="disagree"):
        disp.dispatch(torch.randn(3, 3), torch.tensor([[0, 1], [1, 2]]))


def test_one_process_dispatch_combine_and_backward_read_the_host_twice():
    """A GPU waits wherever the host reads a device value: the dispatch reads twice (the
    input check's min/max, the grouping's counts), the combine and both backwards never."""
    from sync_count import host_syncs

    torch.manual_seed(0)
    disp = MoEDispatcher(8)
    x = torch.randn(32, 16, requires_grad=True)
    idx = torch.rand(32, 8).topk(3, dim=1).indices
    w = torch.rand(32, 3, requires_grad=True)
    with host_syncs() as dispatch:
        d = disp.dispatch(x, idx, w)
    with host_syncs() as rest:
        out = disp.combine(d.x * 2, d.handle, d.weights)
        out.sum().backward()
    assert dispatch == {"reads": 2}, dispatch
    assert rest == {}, rest
    assert sum(d.tokens_per_expert) == 32 * 3 and x.grad is not None and w.grad is not None
