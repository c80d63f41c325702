"""The runtime's recompute modes (parallel.recompute): same gradients, and the backward re-runs
exactly the work each mode says it does, counted op by op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from aihpc.runspec import SpecError
from aihpc.runtime.model import Llama, LlamaConfig
from aihpc.runtime.moe import MoEConfig

LAYERS = 3
CFG = LlamaConfig(
    dim=64, num_layers=LAYERS, num_heads=4, num_kv_heads=2, ffn_dim=128, vocab_size=256,
    max_seq_len=32,
)  # fmt: skip
MM = torch.ops.aten.mm.default
SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[object, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.counts[func] = self.counts.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def backward_ops(recompute: str) -> tuple[float, list[torch.Tensor], dict[object, int]]:
    with torch.device("meta"):
        model = Llama(CFG, recompute)
    model.to_empty(device="cpu")
    model.init_weights(7)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len + 1), generator=gen)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    mode = CountOps()
    with mode:
        loss.backward()
    return loss.item(), [p.grad for p in model.parameters()], mode.counts


@pytest.fixture(scope="module")
def plain():
    return backward_ops("none")


@pytest.mark.parametrize("recompute", ["selective", "op", "full"])
def test_recompute_gives_the_same_gradients_bit_for_bit(plain, recompute: str) -> None:
    loss, grads, _ = backward_ops(recompute)
    assert loss == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(grads, plain[1], strict=True))


def test_each_mode_recomputes_what_it_says(plain) -> None:
    base = plain[2]
    assert base.get(SDPA, 0) == 0  # without recompute the backward runs no attention forward

    def extra(recompute: str, op: object) -> int:
        return backward_ops(recompute)[2].get(op, 0) - base.get(op, 0)

    # selective: the attention core again, once per layer, and no matmul.
    assert extra("selective", SDPA) == LAYERS and extra("selective", MM) == 0
    # op: the three matmuls it did not keep (wk, wo, w3 of the seven), not the attention.
    assert extra("op", MM) == 3 * LAYERS and extra("op", SDPA) == 0
    # full: the whole layer; the recompute stops once the backward has every tensor it needs,
    # so the last matmul (w2), whose output nothing saves, may be skipped.
    assert extra("full", SDPA) == LAYERS
    assert 6 * LAYERS <= extra("full", MM) <= 7 * LAYERS


def test_unknown_mode_is_refused_with_the_field() -> None:
    with pytest.raises(SpecError, match=r"parallel\.recompute"):
        Llama(CFG, "sometimes")


# parallel.recompute_modules: the named modules' forwards run again in the backward (Megatron-
# Core's --recompute-modules), the gradients those of no recompute.
MOE_CFG = LlamaConfig(
    dim=64, num_layers=LAYERS, num_heads=4, num_kv_heads=2, ffn_dim=128, vocab_size=256,
    max_seq_len=32, moe=MoEConfig(dim=64, num_experts=4, top_k=2, expert_ffn_dim=32),
)  # fmt: skip
RSQRT = torch.ops.aten.rsqrt.default
SILU = torch.ops.aten.silu.default


def module_backward(cfg: LlamaConfig, modules: tuple[str, ...]):
    with torch.device("meta"):
        model = Llama(cfg, "none", modules)
    model.to_empty(device="cpu")
    model.init_weights(7)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len + 1), generator=gen)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    mode = CountOps()
    with mode:
        loss.backward()
    return loss.item(), [p.grad for p in model.parameters()], mode.counts


@pytest.mark.parametrize(
    ("cfg", "modules"),
    [(CFG, ("layernorm",)), (CFG, ("mlp",)), (MOE_CFG, ("moe_act",)), (MOE_CFG, ("layernorm",))],
)
def test_recompute_modules_give_the_same_gradients(cfg, modules) -> None:
    """layernorm and mlp re-run the same forward (torch checkpoint): bit for bit. moe_act's
    backward makes the SwiGLU output again and takes the two matmul gradients itself: the same
    ops on the same values, so bit for bit too."""
    ref = module_backward(cfg, ())
    loss, grads, _ = module_backward(cfg, modules)
    assert loss == ref[0]
    for a, b in zip(grads, ref[1], strict=True):
        assert torch.equal(a, b)


def test_recompute_modules_recompute_what_they_name() -> None:
    def extra(cfg: LlamaConfig, modules: tuple[str, ...], op: object) -> int:
        return module_backward(cfg, modules)[2].get(op, 0) - module_backward(cfg, ())[2].get(op, 0)

    # layernorm: both norms of every layer again (one rsqrt each), nothing else
    assert extra(CFG, ("layernorm",), RSQRT) == 2 * LAYERS
    assert extra(CFG, ("layernorm",), MM) == 0
    # mlp: the dense FFN's three matmuls (the last may be skipped, as under full recompute)
    assert 2 * LAYERS <= extra(CFG, ("mlp",), MM) <= 3 * LAYERS
    # moe_act: one SwiGLU per expert that got tokens, no matmul forward again
    assert extra(MOE_CFG, ("moe_act",), SILU) > 0
    assert extra(MOE_CFG, ("moe_act",), MM) == 0


def test_a_module_the_trainer_has_not_is_refused() -> None:
    with pytest.raises(SpecError, match=r"parallel\.recompute_modules"):
        Llama(CFG, "none", ("mla_up_proj",))
