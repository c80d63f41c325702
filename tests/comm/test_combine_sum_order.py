"""The bf16 combine's sum order, as docs/runtime.md states it, checked bit for bit on 2 gloo
ranks: each rank sums its experts' weighted outputs in float32 (ascending expert order) and
rounds that partial to bf16 before it travels; the source rank sums the partials in float32
(ascending rank order) and rounds once more. DeepEP's combine rounds at each hop the same way;
a float32 sum throughout would send twice the bytes."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from comm_workers import bf16_combine_order

from aihpc.bench.dist import launch_local

pytestmark = pytest.mark.slow


def test_bf16_combine_rounds_each_ranks_partial_then_sums_in_fp32():
    per_rank = launch_local(2, bf16_combine_order, 3)
    for rank, r in enumerate(per_rank):
        assert r["dtype"] == "torch.bfloat16"
        assert r["mismatch"] == 0, (rank, r)
    # the rounding of the partials is real on this data: a float32 sum throughout differs
    assert sum(r["differs_from_fp32_sum"] for r in per_rank) > 0, per_rank
