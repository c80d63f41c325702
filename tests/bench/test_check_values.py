"""The check's inputs: their reduction is exact in the data type in any order (zero tolerance)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from aihpc.bench.comm import TORCH_DTYPES, _values  # noqa: E402


@pytest.mark.parametrize(
    ("dtype", "n"),
    [("bfloat16", 8), ("bfloat16", 300), ("half", 64), ("float", 8), ("float", 1024)],
)
def test_sum_is_exact_in_any_order(dtype, n):
    idx = torch.arange(4096)
    parts = [_values(idx, r, n, "sum", dtype, seed=3) for r in range(n)]
    exact = torch.stack(parts).sum(0)  # int64, the true sum
    assert (exact != 0).float().mean() > 0.5  # the check is not a sum of zeros
    tdt = TORCH_DTYPES[dtype]
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):  # different reduction orders, accumulated in the data type itself
        acc = torch.zeros(4096, dtype=tdt)
        for r in torch.randperm(n, generator=gen).tolist():
            acc += parts[r].to(tdt)
        assert torch.equal(acc, exact.to(tdt))
        assert torch.equal(acc.to(torch.int64), exact)


@pytest.mark.parametrize("op", ["prod", "max", "min"])
def test_other_ops_exact_in_bf16(op):
    n, idx = 16, torch.arange(1024)
    parts = [_values(idx, r, n, op, "bfloat16", seed=1) for r in range(n)]
    fn = {
        "prod": torch.prod,
        "max": lambda t, d: t.max(d).values,
        "min": lambda t, d: t.min(d).values,
    }[op]
    exact = fn(torch.stack(parts), 0)
    got = fn(torch.stack([p.to(torch.bfloat16) for p in parts]), 0)
    assert torch.equal(got.to(torch.int64), exact)
    assert len(torch.unique(exact)) > 1  # varied values, so a misplaced element is caught
