"""FLOPs and parameter counts against published figures and independent formulas."""

import pytest

from aihpc.perf.step.flops import model_flops_per_token, num_params
from aihpc.runspec.model import model_from_table


@pytest.mark.parametrize(
    ("preset", "published_b"),
    [
        # Llama 3 paper Table 3 / model cards; Llama 2 model cards; GPT-3 paper Table 2.1.
        ("llama3-8b", 8.03),
        ("llama3-70b", 70.6),
        ("llama3-405b", 405.9),
        ("llama2-7b", 6.74),
        ("llama2-70b", 69.0),
        ("gpt3-175b", 174.6),
        ("nemotron4-15b", 15.6),
    ],
)
def test_num_params_matches_published(preset: str, published_b: float) -> None:
    got = num_params(model_from_table({"preset": preset})) / 1e9
    assert got == pytest.approx(published_b, rel=0.015)


@pytest.mark.parametrize("preset", ["gpt3-175b"])
def test_flops_match_megatron_72_formula(preset: str) -> None:
    """Korthikanti et al. 2022: 72 B s L h^2 (1 + s/6h + V/12Lh) per iteration, MHA + 4h GELU."""
    m = model_from_table({"preset": preset})
    h, L, s, V = m.hidden_size, m.num_layers, m.seq_length, m.vocab_size
    megatron = 72 * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    assert model_flops_per_token(m) == pytest.approx(megatron, rel=1e-9)


def test_flops_match_gqa_swiglu_formula() -> None:
    """NeMo's llama3 formula: s L h^2 (12 + 12g/a + 18f/h + 12 s/h + 6V/(L h)) per sequence."""
    m = model_from_table({"preset": "llama3-70b"})
    h, L, s, V = m.hidden_size, m.num_layers, m.seq_length, m.vocab_size
    a, g, f = m.num_attention_heads, m.kv_heads, m.ffn_hidden_size
    per_seq = s * L * h * h * (12 + 12 * g / a + 18 * f / h + 12 * s / h + 6 * V / (L * h))
    assert model_flops_per_token(m) * s == pytest.approx(per_seq, rel=1e-9)
