"""Megatron-Core's 1F1B A2A overlap hides each transfer behind the one sub-module it is paired
with (perf/step/moe_overlap.py), DualPipe up to the whole layer: the window math and how the
step prices a plan with each schedule."""

from dataclasses import replace

import pytest

from aihpc.perf.step.compute import layer_times
from aihpc.perf.step.estimate import estimate_plan
from aihpc.perf.step.moe_overlap import paired_exposed_s
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec.runspec import RunSpec, runspec_from_dict


def spec(a2a: str, gpu: str = "h100-sxm", gpus: int = 1024, ep: int = 64) -> RunSpec:
    return runspec_from_dict(
        {
            "model": {"preset": "deepseek-v3"},
            "cluster": {"gpu": gpu, "num_gpus": gpus},
            "parallel": {
                "tp": 2,
                "pp": 8,
                "vpp": 4,
                "cp": 1,
                "ep": ep,
                "zero_stage": 1,
                "recompute": "none",
                "micro_batch_size": 1,
                "global_batch_size": 8192,
                "moe_a2a_overlap": a2a,
            },
            "training": {"precision": "fp8", "moe_stack": "megatron-deepep"},
        }
    )


def test_each_transfer_hides_behind_its_partner_only() -> None:
    # Every partner longer than its transfer: nothing exposed.
    assert paired_exposed_s(1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 1.0) == 0.0
    # One short partner: only its window leaks, the long ones cannot lend it their slack.
    assert paired_exposed_s(1.0, 1.0, 0.25, 9.0, 9.0, 9.0, 1.0) == pytest.approx(0.75)
    # The four windows: combine_bwd | attn_fwd, dispatch | mlp_bwd, dispatch_bwd | mlp_fwd,
    # combine | attn_bwd; the backward transfers move the combine's (16-bit) bytes.
    got = paired_exposed_s(0.5, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0)
    assert got == pytest.approx(0.5 + 3 * 1.0)
    # The collective's SMs slow the partner: a partner equal to its transfer leaks 1 - eff.
    assert paired_exposed_s(1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.85) == pytest.approx(4 * 0.15)


def test_the_moe_block_and_attention_side_split_the_layer() -> None:
    s = spec("1f1b")
    lt = layer_times(s.model, s.cluster.gpu, s.plan(), s.training, DEFAULT_PARAMS, moe=True)
    assert 0 < lt.mlp_fwd < lt.fwd and 0 < lt.mlp_bwd < lt.bwd
    dense = layer_times(s.model, s.cluster.gpu, s.plan(), s.training, DEFAULT_PARAMS)
    assert dense.mlp_fwd == 0.0 and dense.mlp_bwd == 0.0


def test_1f1b_hides_less_than_the_whole_layer_and_dualpipe_more() -> None:
    def ep(a2a: str) -> float:
        s = spec(a2a)
        return estimate_plan(s.model, s.cluster, s.plan(), s.training).time_s["ep_comm"]

    none, f1b = ep("none"), ep("1f1b")
    assert 0 < f1b < none
    # DualPipe's windows are the whole layer's compute, so it hides at least what 1F1B does.
    s = spec("dualpipe")
    dual = replace(s.plan(), vpp=1)
    est = estimate_plan(s.model, s.cluster, dual, s.training).time_s["ep_comm"]
    one = replace(s.plan(), vpp=1, moe_a2a_overlap="1f1b")
    assert est <= estimate_plan(s.model, s.cluster, one, s.training).time_s["ep_comm"]
