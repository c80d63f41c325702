"""benchmarks/moe_layer_eager.py: the timed block (run here on CPU, tiny shapes) computes the
routed layer it claims to, with the forced routing balanced; its model column is the estimate's
own pricing of the routed part (routed_expert_gemms and the MoE element-wise traffic). Its
refusal without a GPU is tested with moe_expert_gemms.py's."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from aihpc.perf.step.gemm import stream_time_s
from aihpc.perf.step.moe_kernels import routed_expert_gemms
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec.cluster import gpu_from_id

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_layer_eager.py"


def _script():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import moe_layer_eager
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return moe_layer_eager


@pytest.mark.parametrize("compute", ["loop", "grouped_mm"])
def test_the_timed_block_is_the_weighted_sum_of_the_chosen_experts(compute: str) -> None:
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    mle = _script()
    torch.manual_seed(0)
    dim, ffn, experts, local, k, tokens = 16, 32, 12, 4, 2, 10
    forward, x, block = mle.routed_block(
        dim, ffn, experts, local, k, tokens, compute, "cpu", torch.float32
    )
    out = forward()
    idx = mle.balanced_choice(tokens, k, local, "cpu")
    assert torch.bincount(idx.flatten(), minlength=local).tolist() == [tokens * k // local] * 4
    assert all(len(set(r)) == k for r in idx.tolist())  # distinct experts per token
    # reference, token by token: gate weights from the router's scores over all experts
    scores = F.linear(x.float(), block.gate.float()).softmax(dim=-1)
    w1, w3, w2 = (p.detach() for p in (block.experts.w1, block.experts.w3, block.experts.w2))
    ref = torch.zeros(tokens, dim)
    for t in range(tokens):
        g = scores[t, idx[t]]
        g = g / g.sum()
        for j, e in enumerate(idx[t].tolist()):
            ref[t] += g[j] * ((F.silu(x[t] @ w1[e]) * (x[t] @ w3[e])) @ w2[e])
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    out.backward(torch.ones_like(out))  # gradients reach the router and every expert
    assert block.gate.grad is not None and block.gate.grad.abs().sum() > 0
    assert all(p.grad.abs().sum() > 0 for p in block.experts.parameters())


def test_model_column_is_the_estimates_routed_part_in_bf16() -> None:
    mle = _script()
    s = mle.shapes("H09")
    spec = s["spec"]
    gpu = gpu_from_id("h200")
    training = dataclasses.replace(spec.training, precision="bf16", moe_expert_gemm="grouped")
    fwd, bwd, moved = routed_expert_gemms(
        spec.model, gpu, spec.plan(), training, DEFAULT_PARAMS, None
    )
    expect_fwd = (fwd + stream_time_s(moved, gpu, DEFAULT_PARAMS, kernels=5)) * 1e3
    expect_bwd = (bwd + stream_time_s(2 * moved, gpu, DEFAULT_PARAMS, kernels=10)) * 1e3
    assert mle.model_ms(s, "h200", "grouped_mm") == pytest.approx((expect_fwd, expect_bwd))
    # the per-expert launches cost more than one grouped GEMM per projection
    loop = mle.model_ms(s, "h200", "loop")
    assert loop[0] > expect_fwd and loop[1] > expect_bwd
