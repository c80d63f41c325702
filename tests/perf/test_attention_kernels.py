"""Attention kernel classes: the efficiency curve over the call's key length, the published
ratios between implementations, one arithmetic for floats and arrays, and what a layer pays."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from aihpc.interop.megatron import export_megatron
from aihpc.perf.step.attention_kernels import (
    KERNELS,
    REFERENCE_TOKENS,
    kernel_efficiency,
    kernel_tokens,
    length_factor,
)
from aihpc.perf.step.compute import layer_times
from aihpc.perf.step.estimate import estimate_plan
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec import runspec_from_dict
from aihpc.runspec.errors import SpecError
from aihpc.runspec.training import ATTENTION, TrainingSpec

LENGTHS = [512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0, 131072.0, 1048576.0]
HOPPER = ((0.65, 0.50), (0.35, 0.28))  # h100-sxm's best kernel and FlashAttention-2


def spec(attention: str, seq: int = 8192, cp: int = 1, gpu: str = "h100-sxm"):
    return runspec_from_dict(
        {
            "model": {"preset": "llama3-8b", "seq_length": seq},
            "cluster": {"gpu": gpu, "num_gpus": 8, "gpus_per_node": 8},
            "parallel": {
                "tp": 1,
                "cp": cp,
                "pp": 1,
                "zero_stage": 1,
                "recompute": "none",
                "micro_batch_size": 1,
                "global_batch_size": 8 // cp,
            },
            "training": {"attention": attention},
        }
    )


def test_every_fused_name_of_the_run_spec_has_a_kernel_class() -> None:
    assert set(KERNELS) | {"unfused"} == set(ATTENTION)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_efficiency_rises_with_the_call_length_and_levels_off(kernel: str) -> None:
    fwd, bwd = kernel_efficiency(kernel, *HOPPER, np.array(LENGTHS))
    for curve, half in (
        (fwd, KERNELS[kernel].half_fwd_tokens),
        (bwd, KERNELS[kernel].half_bwd_tokens),
    ):
        assert np.all(np.diff(curve) > 0)
        # the long-sequence limit is the catalog figure x (1 + s_half / s_ref), never beyond
        limit = curve[LENGTHS.index(REFERENCE_TOKENS)] * (1 + half / REFERENCE_TOKENS)
        assert curve[-1] < limit
        assert curve[-1] == pytest.approx(limit, rel=2e-3)
        assert curve[0] < 0.8 * curve[-1]  # a 512-token call is well short of it


def test_the_catalog_figure_is_the_reference_length_figure() -> None:
    for kernel, k in KERNELS.items():
        fwd, bwd = kernel_efficiency(kernel, *HOPPER, REFERENCE_TOKENS)
        base = HOPPER[0] if k.base == "best" else HOPPER[1]
        assert fwd == pytest.approx(base[0] * k.fwd_ratio, rel=1e-12)
        assert bwd == pytest.approx(base[1] * k.bwd_ratio, rel=1e-12)
    assert length_factor(REFERENCE_TOKENS, 1000.0) == pytest.approx(1.0, rel=1e-15)


def test_older_and_generated_kernels_are_slower_than_flashattention2_at_any_length() -> None:
    for s in LENGTHS:
        eff = {k: kernel_efficiency(k, *HOPPER, s) for k in KERNELS}
        for older in ("flex", "triton", "flash1"):
            assert eff[older][0] < eff["flash2"][0] and eff[older][1] < eff["flash2"][1]
        # forward: xformers' 2x < Triton's 1.3-1.5x < FlexAttention's 0.90; backward: both 2x
        assert eff["flash1"][0] < eff["triton"][0] < eff["flex"][0]
        assert max(eff["flash1"][1], eff["triton"][1]) < eff["flex"][1]
        assert eff["flash"][0] > eff["flash2"][0] and eff["flash"][1] > eff["flash2"][1]


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_arrays_price_as_floats_do(kernel: str) -> None:
    seq = np.array([2048.0, 8192.0, 131072.0, 131072.0])
    cp = np.array([1.0, 2.0, 4.0, 16.0])
    fwd, bwd = kernel_efficiency(kernel, *HOPPER, kernel_tokens(seq, cp))
    for i in range(len(seq)):
        f, b = kernel_efficiency(kernel, *HOPPER, kernel_tokens(float(seq[i]), float(cp[i])))
        assert (fwd[i], bwd[i]) == (f, b)  # the same arithmetic, bit for bit


def test_a_layer_pays_its_kernel_class() -> None:
    s = spec("flash2")
    gpu, plan = s.cluster.gpu, s.plan()
    t = {
        k: layer_times(s.model, gpu, plan, replace(s.training, attention=k), DEFAULT_PARAMS)
        for k in ATTENTION
    }
    assert t["flash"].bwd_attn < t["flash2"].bwd_attn < t["flex"].bwd_attn
    assert t["flex"].bwd_attn < min(t["triton"].bwd_attn, t["flash1"].bwd_attn)
    assert t["flex"].fwd_attn < t["triton"].fwd_attn < t["flash1"].fwd_attn
    # FlashAttention-2's backward at the published 2x of xformers': the attention core only
    ratio = (t["flash1"].bwd_attn - 4e-6) / (t["flash2"].bwd_attn - 4e-6)
    assert ratio == pytest.approx(
        2
        * length_factor(8192.0, KERNELS["flash2"].half_bwd_tokens)
        / length_factor(8192.0, KERNELS["flash1"].half_bwd_tokens),
        rel=1e-9,
    )
    for k in ATTENTION:  # the GEMMs do not depend on the attention kernel
        assert t[k].fwd_gemm == t["flash"].fwd_gemm


def test_short_calls_cost_more_per_flop_than_long_ones() -> None:
    """The same 8K sequence split over 4 context-parallel ranks runs 2K-key calls: per unit of
    attention work the rank's kernels are slower than one 8K call's."""
    whole, split = spec("flash2", 8192, 1), spec("flash2", 8192, 4)
    a = layer_times(whole.model, whole.cluster.gpu, whole.plan(), whole.training, DEFAULT_PARAMS)
    b = layer_times(split.model, split.cluster.gpu, split.plan(), split.training, DEFAULT_PARAMS)
    # each CP rank does 1/4 of the causal work: exactly 1/4 of the time at equal efficiency
    assert 4 * (b.bwd_attn - 4e-6) > 1.1 * (a.bwd_attn - 4e-6)


def test_an_older_kernel_lengthens_the_step_not_the_memory() -> None:
    a = estimate_plan(*_parts(spec("flash2", 32768)))
    b = estimate_plan(*_parts(spec("flash1", 32768)))
    assert b.step_time_s > 1.2 * a.step_time_s  # attention is most of a 32K layer
    assert b.memory.total == a.memory.total  # every fused kernel keeps only its log-sum-exp


def test_megatron_export_refuses_a_kernel_megatron_does_not_have() -> None:
    with pytest.raises(SpecError, match=r"training\.attention"):
        export_megatron(spec("flex"))
    export_megatron(spec("flash2"))


def test_an_unknown_kernel_is_refused_with_the_allowed_ones() -> None:
    with pytest.raises(SpecError, match="flash1"):
        TrainingSpec(attention="flash4")


def _parts(s):
    return s.model, s.cluster, s.plan(), s.training


@pytest.mark.parametrize(
    ("backend", "kernel"), [("flash", "flash2"), ("cudnn", "flash"), ("efficient", "flash1")]
)
def test_half_lengths_are_the_fit_of_the_h200_sweep(backend: str, kernel: str) -> None:
    """The curve's constants come from the measured sweep: least squares of 1 / TFLOP/s against
    1 / s over the causal rows of benchmarks/results/kernel_efficiency_h200.json."""
    path = Path(__file__).resolve().parents[2] / "benchmarks/results/kernel_efficiency_h200.json"
    rows = [
        r
        for r in json.loads(path.read_text())["attention"]
        if r["backend"] == backend and r["causal"]
    ]
    assert len(rows) >= 5
    x = np.array([1 / r["skv"] for r in rows])
    for key, half in (
        ("fwd_tflops", KERNELS[kernel].half_fwd_tokens),
        ("bwd_tflops", KERNELS[kernel].half_bwd_tokens),
    ):
        y = np.array([1 / r[key] for r in rows])
        slope, intercept = np.polyfit(x, y, 1)
        assert slope / intercept == pytest.approx(half, abs=0.5)


# The FlashAttention-3 paper's H100 sweeps (Shah et al. 2024, figs. 5-6), TF/s at 4K, 8K and 16K
# tokens: (head dim 64, head dim 128) forward and backward, FlashAttention-3 and -2.
FA3_PAPER = {
    "flash": {
        "fwd": ((476, 638), (496, 646), (497, 648)),
        "bwd": ((453, 542), (472, 559), (474, 561)),
    },
    "flash2": {
        "fwd": ((321, 368), (322, 370), (324, 370)),
        "bwd": ((279, 310), (287, 318), (291, 322)),
    },
}


@pytest.mark.parametrize("kernel", ["flash", "flash2"])
def test_head_dim_64_runs_at_the_published_share_of_head_dim_128(kernel: str) -> None:
    from aihpc.perf.step.attention_kernels import head_dim_factor

    fwd, bwd = head_dim_factor(kernel, 64)
    for got, pairs in ((fwd, FA3_PAPER[kernel]["fwd"]), (bwd, FA3_PAPER[kernel]["bwd"])):
        assert got == pytest.approx(sum(a / b for a, b in pairs) / len(pairs), abs=0.005)
    assert head_dim_factor(kernel, 128) == (1.0, 1.0) == head_dim_factor(kernel, 256)
    assert head_dim_factor(kernel, 32) == head_dim_factor(kernel, 64)
    mid = head_dim_factor(kernel, 96)
    assert fwd < mid[0] < 1 and bwd < mid[1] < 1
    # flex, triton and flash1 are priced as fractions of FlashAttention-2, so they scale as it
    assert head_dim_factor("flex", 64) == head_dim_factor("flash2", 64)


def test_head_dim_prices_full_layers_and_spares_calibrated_parts() -> None:
    import dataclasses

    from aihpc.perf.step.compute import _Kernels, attention_times
    from aihpc.perf.step.params import DEFAULT_PARAMS
    from aihpc.runspec.cluster import gpu_from_id
    from aihpc.runspec.model import ModelSpec
    from aihpc.runspec.parallel import ParallelPlan
    from aihpc.runspec.training import TrainingSpec

    def attn(head_dim: int, gpu) -> tuple[float, float]:
        # the same FLOPs at both head dims: heads x head_dim fixed
        m = ModelSpec(
            num_layers=1,
            hidden_size=4096,
            num_attention_heads=4096 // head_dim,
            head_dim=head_dim,
            ffn_hidden_size=64,
            vocab_size=16,
            seq_length=8192,
        )
        plan = ParallelPlan(micro_batch_size=1, global_batch_size=1)
        k = _Kernels(m, gpu, plan, TrainingSpec(), DEFAULT_PARAMS, None, False)
        return attention_times(k)[:2]

    h100 = gpu_from_id("h100-sxm")
    (f64, b64), (f128, b128) = attn(64, h100), attn(128, h100)
    overhead = DEFAULT_PARAMS.kernel_overhead_s
    assert (f64 - overhead) / (f128 - overhead) == pytest.approx(1 / 0.76)
    assert (b64 - overhead) / (b128 - overhead) == pytest.approx(1 / 0.84)
    # a part timed by aihpc calibrate --local on the spec model's own calls keeps its figures
    timed = dataclasses.replace(h100, attention_tokens=8192.0)
    assert attn(64, timed) == pytest.approx(attn(128, timed))
