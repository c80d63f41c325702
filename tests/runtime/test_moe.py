"""The MoE block on one process: routing semantics, balancing, expert compute, and the Llama
decoder with MoE layers. Multi-process expert parallelism is in test_moe_ep.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from aihpc.perf.step.flops import num_params  # noqa: E402
from aihpc.runspec import ModelSpec, SpecError  # noqa: E402
from aihpc.runtime.model import Llama, LlamaConfig  # noqa: E402
from aihpc.runtime.moe import MoE, MoEConfig, Router, update_expert_bias  # noqa: E402

CFG = MoEConfig(dim=8, num_experts=6, top_k=2, expert_ffn_dim=5, num_shared_experts=1)


def _block(**kw) -> MoE:
    torch.manual_seed(0)
    return MoE(MoEConfig(**{**CFG.__dict__, **kw})).double()


def _routing(block: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's (idx, weights) for x, captured by a hook during the block's forward."""
    seen = {}
    handle = block.router.register_forward_hook(lambda m, a, out: seen.update(out=out))
    block(x)
    handle.remove()
    return seen["out"][0], seen["out"][1]


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_block_equals_the_formula_written_out(score):
    """y[t] = shared(x_t) + sum_j w_tj * SwiGLU_{e_tj}(x_t), token by token, float64; and the
    gradients of both agree (the grouped compute and the local dispatch / combine are right)."""
    block = _block(score_func=score, route_scale=2.5)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    idx, w = _routing(block, x)
    y = block(x)
    ex = block.experts
    h = x.reshape(-1, 8)
    ref = []
    for t in range(h.shape[0]):
        acc = block.shared(h[t])
        for j in range(CFG.top_k):
            e = int(idx[t, j])
            acc = acc + w[t, j] * ((F.silu(h[t] @ ex.w1[e]) * (h[t] @ ex.w3[e])) @ ex.w2[e])
        ref.append(acc)
    ref = torch.stack(ref).view_as(y)
    assert (y - ref).abs().max() < 1e-14
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, *block.parameters()], g)
    ref_grads = torch.autograd.grad(ref, [x, *block.parameters()], g)
    for a, b in zip(grads, ref_grads, strict=True):
        assert (a - b).abs().max() < 1e-13


@pytest.mark.parametrize("compute", ["loop", "grouped_mm"])
def test_a_training_step_of_the_block_reads_the_host_twice(compute):
    """What a GPU would wait for in one MoE block's training forward and backward (counted on
    the CPU: tests/sync_count.py): the dispatch's input check and its grouping counts, which
    the per-expert split needs; the router's load count and the loop's weights take none."""
    from sync_count import host_syncs

    block = _block(expert_compute=compute, aux_loss_coeff=0.01, expert_ffn_dim=8).float()
    x = torch.randn(2, 5, 8, requires_grad=True)
    with host_syncs() as syncs:
        block(x).sum().backward()
    assert syncs == {"reads": 2}, syncs
    assert block.router.load is not None and int(block.router.load.sum()) == 2 * 5 * 2


def test_softmax_gate_is_a_softmax_over_the_top_k_logits():
    """Mixtral's gate: softmax over the k chosen logits = normalised softmax scores."""
    router = Router(CFG).double()
    h = torch.randn(7, 8, dtype=torch.float64)
    idx, w, aux = router(h, 7)
    logits = h @ router.gate.weight.T
    assert torch.equal(idx, logits.topk(2).indices)
    assert torch.allclose(w, logits.gather(1, idx).softmax(-1), atol=1e-15)
    assert aux is None


def test_bias_changes_the_choice_not_the_weights():
    """DeepSeek-V3 eq. 16: the balancing bias enters the choice only."""
    router = Router(MoEConfig(**{**CFG.__dict__, "score_func": "sigmoid"})).double()
    h = torch.randn(9, 8, dtype=torch.float64)
    router.expert_bias[4] = 10.0  # expert 4 wins for every token
    idx, w, _ = router(h, 9)
    assert (idx == 4).any(dim=1).all()
    scores = torch.sigmoid(h @ router.gate.weight.T).gather(1, idx)
    assert torch.allclose(w, scores / scores.sum(-1, keepdim=True), atol=1e-15)


def test_group_limited_routing_stays_in_the_best_groups():
    cfg = MoEConfig(dim=8, num_experts=8, top_k=2, expert_ffn_dim=4, num_groups=4, topk_groups=1)
    router = Router(cfg).double()
    h = torch.randn(50, 8, dtype=torch.float64)
    idx, _, _ = router(h, 50)
    groups = idx // 2
    assert (groups[:, 0] == groups[:, 1]).all()  # both experts in one group of two
    scores = torch.softmax(h @ router.gate.weight.T, -1).view(50, 4, 2).sum(-1)
    assert torch.equal(groups[:, 0], scores.argmax(-1))  # the group with the best top-2 sum


def test_bias_update_balances_the_load():
    """Fixed inputs skewed towards one expert; the bias alone (no training) must spread them:
    the busiest expert's load falls from over 2x the mean to below 1.3x."""
    torch.manual_seed(1)
    cfg = MoEConfig(**{**CFG.__dict__, "score_func": "sigmoid", "bias_update_rate": 0.01})
    block = MoE(cfg)
    h = torch.randn(1, 240, 8) + 5 * block.router.gate.weight[0]  # everyone likes expert 0
    imbalance = []
    for _ in range(60):
        block(h)
        load = block.router.load.clone()
        imbalance.append(float(load.max() / load.mean()))
        update_expert_bias(block)
    assert imbalance[0] > 2.0 and imbalance[-1] < 1.3, imbalance[::10]
    assert block.router.load is None  # the update consumed the counts


def test_sequence_balance_loss_value_and_gradient():
    """DeepSeek-V3 eq. 17-20 on a case small enough to write out: with every score equal, f_i is
    E/(kT) * count_i and P_i = 1/E, so the loss is alpha * sum_i count_i / (kT) = alpha."""
    cfg = MoEConfig(dim=4, num_experts=4, top_k=2, expert_ffn_dim=3, aux_loss_coeff=0.1)
    router = Router(cfg).double()
    torch.nn.init.zeros_(router.gate.weight)  # equal scores
    _, _, aux = router(torch.randn(6, 4, dtype=torch.float64), 3)
    assert abs(float(aux.detach()) - 0.1) < 1e-15
    # the loss's gradient reaches the gate through the block output (and only its gradient)
    block = _block(aux_loss_coeff=0.5)
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    (block(x) * 0).sum().backward()
    aux_grad = block.router.gate.weight.grad.clone()
    block.zero_grad()
    _, _, aux2 = block.router(x.reshape(-1, 8), 4)
    aux2.backward()
    assert aux_grad.abs().max() > 0
    assert torch.allclose(aux_grad, block.router.gate.weight.grad, atol=1e-15)


def test_recompute_does_not_count_tokens_twice():
    cfg = MoEConfig(**{**CFG.__dict__, "bias_update_rate": 0.01})
    block = MoE(cfg)
    x = torch.randn(2, 5, 8, requires_grad=True)
    checkpoint(block, x, use_reentrant=False).sum().backward()
    assert float(block.router.load.sum()) == 2 * 5 * cfg.top_k


def test_grouped_mm_equals_the_loop():
    """torch's grouped_mm (float32 on CPU; it has no float64) against the per-expert loop."""
    torch.manual_seed(0)
    # rows of a multiple of 16 bytes, as grouped_mm requires
    cfg = {**CFG.__dict__, "expert_ffn_dim": 12}
    loop = MoE(MoEConfig(**{**cfg, "expert_compute": "loop"}))
    grouped = MoE(MoEConfig(**{**cfg, "expert_compute": "grouped_mm"}))
    grouped.load_state_dict(loop.state_dict())
    x = torch.randn(3, 4, 8)
    y1, y2 = loop(x), grouped(x)
    assert torch.allclose(y1, y2, atol=1e-6)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    for name in ("w1", "w3", "w2"):
        a, b = getattr(loop.experts, name).grad, getattr(grouped.experts, name).grad
        assert torch.allclose(a, b, atol=1e-6)


def test_config_refusals_name_the_field():
    with pytest.raises(SpecError, match=r"model\.moe_top_k"):
        MoEConfig(dim=8, num_experts=4, top_k=5, expert_ffn_dim=4)
    with pytest.raises(SpecError, match=r"model\.moe_router_groups"):
        MoEConfig(dim=8, num_experts=6, top_k=2, expert_ffn_dim=4, num_groups=4)
    with pytest.raises(SpecError, match=r"model\.moe_router_score_function"):
        MoEConfig(dim=8, num_experts=4, top_k=2, expert_ffn_dim=4, score_func="relu")


SPEC = ModelSpec(
    num_layers=3,
    hidden_size=32,
    num_attention_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=64,
    ffn_activation="swiglu",
    vocab_size=64,
    seq_length=16,
    num_experts=4,
    moe_top_k=2,
    moe_ffn_hidden_size=24,
    num_shared_experts=1,
    first_dense_layers=1,
)


def test_llama_builds_moe_layers_from_the_spec():
    """First dense layer, then MoE; parameter count equal to the planner's (aihpc.perf)."""
    cfg = LlamaConfig.from_spec(SPEC)
    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    kinds = [type(b.feed_forward).__name__ for b in model.layers.values()]
    assert kinds == ["FeedForward", "MoE", "MoE"]
    assert sum(p.numel() for p in model.parameters()) == num_params(SPEC)
    assert all(
        float(b.feed_forward.router.expert_bias.abs().sum()) == 0
        for b in list(model.layers.values())[1:]
    )
    # the expert output projection gets the residual-branch scale, like every w2
    std = float(model.layers["1"].feed_forward.experts.w2.detach().std())
    assert abs(std - 0.02 / (2 * 3) ** 0.5) < 0.002


def test_llama_with_moe_layers_learns_a_batch():
    """AdamW on one repeated batch: the loss must fall far below its start (ln 64 = 4.16)."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_spec(SPEC))
    model.init_weights(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 64, (4, 17))
    losses = []
    for _ in range(25):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[0] > 3.9 and losses[-1] < 1.5, losses[::6]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grouped_mm_on_gpu_equals_the_loop_in_bf16():
    """On CUDA "auto" takes torch's grouped_mm; bf16 against the per-expert loop within bf16's
    own rounding (torch.testing's bf16 tolerances: rtol 1.6e-2)."""
    torch.manual_seed(0)
    cfg = {**CFG.__dict__, "dim": 64, "expert_ffn_dim": 128, "num_experts": 8}
    auto = MoE(MoEConfig(**cfg)).cuda().bfloat16()
    loop = MoE(MoEConfig(**{**cfg, "expert_compute": "loop"})).cuda().bfloat16()
    loop.load_state_dict(auto.state_dict())
    x = torch.randn(4, 32, 64, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(auto(x), loop(x))


def test_spec_router_fields_reach_the_block():
    """The planner's [model] router fields (group-limited routing, layer frequency) configure
    the trainer's block; 0 groups (the spec's "no group limit") is one group of every expert."""
    from aihpc.runspec.model import model_from_table
    from aihpc.runtime.moe import moe_config_from_spec

    base = {"preset": "tiny-llama", "num_experts": 8, "moe_top_k": 2, "moe_ffn_hidden_size": 32}
    plain = moe_config_from_spec(model_from_table(base))
    assert (plain.num_groups, plain.topk_groups, plain.layer_freq) == (1, 1, 1)
    grouped = moe_config_from_spec(
        model_from_table(
            {**base, "moe_router_groups": 4, "moe_router_group_topk": 2, "moe_layer_freq": 2}
        )
    )
    assert (grouped.num_groups, grouped.topk_groups, grouped.layer_freq) == (4, 2, 2)
