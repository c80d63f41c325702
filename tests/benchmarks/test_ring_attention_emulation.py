"""The ring-attention rank that benchmarks/ring_attention_rank.py times on a GPU computes exactly
causal attention: every rank's head-tail shard, put back in sequence order, equals full causal
attention (CPU, math kernel). Without this its timings would not be of ring attention."""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from ring_attention_rank import gathered, math_attn, measure, ring_rank  # noqa: E402


@pytest.mark.parametrize("cp", [2, 4])
def test_every_rank_together_equals_full_causal_attention(cp: int) -> None:
    gen = torch.Generator().manual_seed(0)
    chunk, heads, dim = 3, 2, 8
    seq = 2 * cp * chunk
    q, k, v = (torch.randn(1, heads, seq, dim, generator=gen, dtype=torch.float64) for _ in "qkv")
    full, _ = math_attn(q, k, v, True)

    def shard(x: torch.Tensor, r: int) -> torch.Tensor:  # chunks r and 2cp-1-r, head then tail
        parts = x.split(chunk, dim=2)
        return torch.cat([parts[r], parts[2 * cp - 1 - r]], dim=2)

    out = torch.empty_like(q)
    for rank in range(cp):
        # Step i brings the K/V of rank (rank - i) mod cp; step 0 is the rank's own.
        ks = [shard(k, (rank - i) % cp) for i in range(cp)]
        vs = [shard(v, (rank - i) % cp) for i in range(cp)]
        mine = ring_rank(shard(q, rank), ks, vs, rank, math_attn)
        head, tail = mine.split(chunk, dim=2)
        out[:, :, rank * chunk : (rank + 1) * chunk] = head
        t0 = (2 * cp - 1 - rank) * chunk
        out[:, :, t0 : t0 + chunk] = tail
    # The blocks are merged in fp32 (as PyTorch's context parallel does, convert_to_f32), so the
    # match is to fp32 rounding; a wrong block or mask is off by O(1).
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-6)


def test_blocks_from_one_gather_buffer_are_the_same_attention_and_gradients() -> None:
    """--gather (one fresh buffer of every rank's K/V per call, blocks as views) changes where
    the K/V live, not what is computed: same output, same gradients back to every rank's K/V."""
    gen = torch.Generator().manual_seed(1)
    cp, shape = 4, (1, 2, 6, 8)

    def leaf() -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    q, ks, vs = leaf(), [leaf() for _ in range(cp)], [leaf() for _ in range(cp)]
    grad = torch.randn(*shape, generator=gen, dtype=torch.float64)
    runs = []
    for blocks in ((ks, vs), gathered(ks, vs)):
        out = ring_rank(q, *blocks, 2, math_attn)
        grads = torch.autograd.grad(out, [q, *ks, *vs], grad)
        runs.append((out, grads))
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=0, atol=0)
    for a, b in zip(runs[0][1], runs[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    timed = measure(16, 2, device="cpu", gather=True, slack=0.05)  # slack: CUDA only
    assert set(timed) == {"fwd_ms", "fwd_bwd_ms"} and timed["fwd_bwd_ms"] > 0
