"""The runtime's recompute modes (parallel.recompute): same gradients, and the backward re-runs
exactly the work each mode says it does, counted op by op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from aihpc.runspec import SpecError
from aihpc.runtime.model import Llama, LlamaConfig

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
