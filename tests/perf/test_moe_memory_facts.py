"""MoE memory as DeepSeek-V3 trained (issue 37 item 3): FP8 caching of the experts' SwiGLU
inputs and the E5M6 attention output, DualPipe's p + 1 micro-batches and two weight copies, and
the README's example of the published 2,048-H800 plan fitting in 80 GiB."""

from __future__ import annotations

import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

from aihpc.perf.search.ranking import search_plans
from aihpc.perf.step.batch_memory import memory_breakdown
from aihpc.perf.step.estimate import estimate_plan
from aihpc.perf.step.memory import GiB, activation_bytes_per_layer
from aihpc.runspec.runspec import runspec_from_dict

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "deepseek-v3-h800.toml"


def example():
    return runspec_from_dict(tomllib.loads(EXAMPLE.read_text()))


def test_deepseek_caching_keeps_less_than_transformer_engines() -> None:
    s = example()
    plan = s.plan()
    te = activation_bytes_per_layer(s.model, plan, replace(s.training, fp8_saved_inputs="fp8"))
    ds = activation_bytes_per_layer(s.model, plan, s.training)
    bf16 = activation_bytes_per_layer(s.model, plan, replace(s.training, fp8_saved_inputs="bf16"))
    assert ds < te < bf16
    # the saving is the routed copies' SwiGLU inputs (half of 4 x expert FFN bytes per copy)
    # and half the attention output's 3 bytes per value, per token
    m = s.model
    tokens = plan.micro_batch_size * m.seq_length
    frac = m.num_moe_layers / m.num_layers
    swiglu = (
        m.moe_top_k * 2 * m.expert_ffn_hidden_size
        + m.num_shared_experts * 2 * m.expert_ffn_hidden_size
    )
    attn = 1.5 * m.num_attention_heads * (m.v_head_dim or 0)
    expected = tokens * (frac * swiglu + attn)
    assert abs((te - ds) - expected) / expected < 1e-9


def test_deepseek_caching_moves_nothing_outside_fp8() -> None:
    s = example()
    bf = replace(s.training, precision="bf16")
    a = activation_bytes_per_layer(s.model, s.plan(), bf)
    b = activation_bytes_per_layer(s.model, s.plan(), replace(bf, fp8_saved_inputs="fp8"))
    assert a == b


def test_dualpipe_holds_one_micro_batch_more_than_1f1b() -> None:
    s = example()
    plan = s.plan()
    dual = memory_breakdown(s.model, s.cluster, plan, s.training)
    one = memory_breakdown(s.model, s.cluster, replace(plan, moe_a2a_overlap="1f1b"), s.training)
    act = activation_bytes_per_layer(s.model, plan, s.training)
    layers = (one.activations - 0) / act  # 1F1B: p micro-batches of the stage's layers
    assert dual.activations > one.activations
    assert (dual.activations - one.activations) / act == pytest.approx(layers / plan.pp)
    assert dual.weights == 2 * one.weights  # two copies (DeepSeek-V3 Table 2)


def test_the_published_plan_fits_and_the_search_finds_it() -> None:
    s = example()
    est = estimate_plan(s.model, s.cluster, s.plan(), s.training)
    assert est.fits and est.memory.total / GiB < 80
    partial = replace(s.parallel, micro_batch_size=None)
    found = search_plans(s.model, s.cluster, partial, s.training, top=3)
    assert found.plans and all(p.fits for p in found.plans)
