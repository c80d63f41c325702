"""training.deterministic: PyTorch's NaN fill of every fresh allocation, priced as traffic
(perf/step/deterministic_fill.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from frozen_vlm_spec import frozen_vlm_spec

from aihpc.perf.fit.vlm_validate import validate_vlm
from aihpc.perf.multimodal.estimate import estimate_vlm
from aihpc.perf.step import deterministic_fill as df
from aihpc.perf.step.gemm import stream_time_s
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec.model import ModelSpec
from aihpc.runspec.runspec import runspec_from_dict


def test_deterministic_mode_fills_what_empty_returns() -> None:
    """The fact the term rests on: under use_deterministic_algorithms(True), with
    fill_uninitialized_memory at its default, a fresh tensor from empty is NaN."""
    assert torch.utils.deterministic.fill_uninitialized_memory is True
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert torch.isnan(torch.empty(64)).all()
        assert torch.isnan(torch.empty_like(torch.ones(8, 8))).all()
    finally:
        torch.use_deterministic_algorithms(was)


def _model(activation: str = "swiglu", kv_heads: int | None = None) -> ModelSpec:
    return ModelSpec(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        ffn_hidden_size=11008,
        vocab_size=32000,
        seq_length=2048,
        num_kv_heads=kv_heads,
        ffn_activation=activation,
    )


# What a Transformer Engine layer (Megatron-Core's TE spec) returns per token, named: forward
# and backward (input gradients), as (elements at tp 1, split by tp).
_FWD = {
    "qkv norm output": (4096, False),
    "qkv": (3 * 4096, True),
    "rotated query": (4096, True),
    "rotated key": (4096, True),
    "attention output": (4096, True),
    "projection": (4096, False),
    "fc1 norm output": (4096, False),
    "fc1 (gated)": (2 * 11008, True),
    "fc2": (4096, False),
}
_BWD = {
    "fc2 dgrad": (11008, True),
    "fc1 dgrad": (4096, False),
    "fc1 norm dx": (4096, False),
    "projection dgrad": (4096, True),
    "attention dq dk dv": (3 * 4096, True),
    "rope dq": (4096, True),
    "rope dk": (4096, True),
    "qkv dgrad": (4096, False),
    "qkv norm dx": (4096, False),
}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_dense_layer_fills_its_te_outputs(tp: int) -> None:
    fwd, bwd = df.fill_elements(_model(), tp)
    assert fwd == sum(n / tp if split else n for n, split in _FWD.values())
    assert bwd == sum(n / tp if split else n for n, split in _BWD.values())
    assert (len(_FWD), len(_BWD)) == (df.FILLS_FWD, df.FILLS_BWD)


def test_grouped_keys_and_an_ungated_mlp_fill_less() -> None:
    fwd, bwd = df.fill_elements(_model(), 1)
    gqa_fwd, gqa_bwd = df.fill_elements(_model(kv_heads=8), 1)
    kv_saved = 3 * (4096 - 8 * 128)  # K and V at 8 of 32 heads, and the rotated K
    assert (fwd - gqa_fwd, bwd - gqa_bwd) == (kv_saved, kv_saved)
    gelu_fwd, gelu_bwd = df.fill_elements(_model("gelu"), 1)
    assert (fwd - gelu_fwd, bwd - gelu_bwd) == (11008, 0)


def _training(on: bool, precision: str = "bf16"):  # type: ignore[no-untyped-def]
    spec = runspec_from_dict(
        {
            "model": {"preset": "llama2-7b"},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 8},
            "parallel": {"dp": 8, "micro_batch_size": 1, "global_batch_size": 8},
            "training": {"precision": precision, "deterministic": on},
        }
    )
    return spec


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp8"])
def test_the_term_is_the_filled_bytes_at_the_bandwidth(precision: str) -> None:
    size = 2  # 16-bit activations, Transformer Engine's GEMM outputs under FP8 too
    spec = _training(True, precision)
    gpu, m = spec.cluster.gpu, spec.model
    tokens, layers, mbs = 3 * 4096.0, 32, 3
    fwd, bwd = df.fill_elements(m, 1)
    got = df.fill_s(m, tokens, layers, 1, mbs, False, gpu, spec.training, DEFAULT_PARAMS)
    want = stream_time_s(
        tokens * layers * (fwd + bwd) * size, gpu, DEFAULT_PARAMS, kernels=mbs * layers * 18
    )
    assert got == pytest.approx(want)
    # full recompute runs each layer's forward twice, and fills twice
    again = df.fill_s(m, tokens, layers, 1, mbs, True, gpu, spec.training, DEFAULT_PARAMS)
    extra = stream_time_s(
        tokens * layers * fwd * size, gpu, DEFAULT_PARAMS, kernels=mbs * layers * 9
    )
    assert again - got == pytest.approx(extra)
    off = _training(False, precision)
    assert df.fill_s(m, tokens, layers, 1, mbs, False, gpu, off.training, DEFAULT_PARAMS) == 0.0


def test_the_megatron_vlm_rows_carry_it_and_a_spec_without_it_does_not() -> None:
    """M1 and M2 (Megatron's MIMO tests pass --deterministic-mode) carry the term; the same
    VLM spec with it off is faster by exactly the term."""
    rows = {r.id: r for r in validate_vlm().rows}
    for rid in ("M1", "M2"):
        assert rows[rid].estimate.time_s["deterministic_fill"] > 0
    for rid in ("V1", "S1", "A1"):
        assert rows[rid].estimate.time_s["deterministic_fill"] == 0.0
    spec = frozen_vlm_spec(deterministic=True)
    on = estimate_vlm(spec)
    off = estimate_vlm(
        dataclasses.replace(spec, training=dataclasses.replace(spec.training, deterministic=False))
    )
    assert off.time_s["deterministic_fill"] == 0.0
    assert on.step_time_s - off.step_time_s == pytest.approx(on.time_s["deterministic_fill"])
    # the rank's tokens a step: 4 micro-batches of 4 sequences at the priced length
    m = 128 // (8 * 4)
    tokens = m * 4 * on.layout.llm_seq
    fwd, bwd = df.fill_elements(spec.model, 1)
    floor = tokens * spec.model.num_layers * (fwd + bwd) * 2 / (spec.cluster.gpu.hbm_bw_GBps * 1e9)
    assert on.time_s["deterministic_fill"] > floor
