"""FSDP2's host work around each unit's all-gather on a GPU (perf/step/fsdp_host.py
``gather_host_s``): the gathers counted per unit and micro-batch agree with the collectives the
trainer is counted to run (test_fsdp_host.py), the figure comes from its data file, and the
term reaches a layer's host issue and an encoder's only where it applies."""

from __future__ import annotations

import csv
import dataclasses
from importlib import resources

import pytest
from cpu_host_spec import cpu_host_spec

from aihpc.perf.multimodal import encoder_host
from aihpc.perf.step import dtensor_host, fsdp_host, host_issue
from aihpc.perf.step.compute import LayerTimes
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec.cluster import gpu_from_id
from aihpc.runspec.parallel import ParallelPlan
from aihpc.runspec.training import TrainingSpec


@pytest.mark.parametrize("zero", [1, 2, 3])
@pytest.mark.parametrize("m", [1, 4])
def test_gathers_per_micro_batch_are_the_counted_collectives(zero: int, m: int) -> None:
    """Over m micro-batches without PP, forward and backward gathers add up to what
    ``collectives`` gives (the count test_fsdp_host.py checks on the trainer's own step)."""
    g_f, g_b = fsdp_host.unit_gathers(zero, 1)
    assert m * (g_f + g_b) == fsdp_host.collectives(2, m, zero)[1]


def test_the_figure_is_the_data_files_per_tensor() -> None:
    text = resources.files("aihpc.perf.step").joinpath("data/fsdp_host_figures.csv").read_text()
    rows = list(csv.DictReader(text.splitlines()))
    assert all(r["source"] for r in rows)
    (used,) = [r for r in rows if r["used"] == "true"]
    tensors = int(used["tensors"])
    assert fsdp_host.gather_host_s(tensors) == pytest.approx(float(used["host_us"]) * 1e-6)
    assert fsdp_host.gather_host_s(2 * tensors) == pytest.approx(
        2 * fsdp_host.gather_host_s(tensors)
    )


def _plan(zero: int, dp: int = 8, tp: int = 1) -> ParallelPlan:
    return ParallelPlan(tp=tp, dp=dp, zero_stage=zero, micro_batch_size=1, global_batch_size=dp)


ZERO_KERNELS = LayerTimes(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


@pytest.mark.parametrize("zero", [1, 3])
def test_a_gpu_layer_issues_its_units_gathers(zero: int) -> None:
    """With no kernel time the layer costs its host issue: the eager ops and, under eager
    FSDP2, its unit's gathers (the decoder layer's tensors), forward and (ZeRO 3) backward."""
    gpu = gpu_from_id("h100-sxm")
    eager = TrainingSpec(fused_kernels=False, dtensor_dispatch="eager")
    plain = dataclasses.replace(eager, dtensor_dispatch="none")
    args = (gpu, _plan(zero), DEFAULT_PARAMS, None)
    with_fsdp = host_issue.with_host_time(ZERO_KERNELS, args[0], args[1], eager, *args[2:])
    without = host_issue.with_host_time(ZERO_KERNELS, args[0], args[1], plain, *args[2:])
    hook = fsdp_host.gather_host_s(dtensor_host.TENSORS_PER_LAYER)
    g_f, g_b = fsdp_host.unit_gathers(zero, 1)
    assert with_fsdp.fwd - without.fwd == pytest.approx(g_f * hook)
    assert with_fsdp.bwd - without.bwd == pytest.approx(g_b * hook)


def test_no_gather_host_without_fsdp_or_on_a_cpu_host() -> None:
    eager = TrainingSpec(fused_kernels=False, dtensor_dispatch="eager")
    plain = dataclasses.replace(eager, dtensor_dispatch="none")
    h100 = gpu_from_id("h100-sxm")
    for plan in (_plan(0), _plan(3, dp=1)):  # DDP; one rank
        a = host_issue.with_host_time(ZERO_KERNELS, h100, plan, eager, DEFAULT_PARAMS, None)
        b = host_issue.with_host_time(ZERO_KERNELS, h100, plan, plain, DEFAULT_PARAMS, None)
        assert (a.fwd, a.bwd) == (b.fwd, b.bwd)
    cpu = cpu_host_spec(10.0, zero_stage=3, dp=2)  # the host is the device
    cpu_plan, cpu_gpu = cpu.plan(), cpu.cluster.gpu
    a = host_issue.with_host_time(ZERO_KERNELS, cpu_gpu, cpu_plan, eager, DEFAULT_PARAMS, None)
    b = host_issue.with_host_time(ZERO_KERNELS, cpu_gpu, cpu_plan, plain, DEFAULT_PARAMS, None)
    assert (a.fwd, a.bwd) == (b.fwd, b.bwd)


def test_an_encoder_gathers_each_block_once_frozen_twice_trained() -> None:
    from aihpc.runspec.runspec import runspec_from_dict

    spec = runspec_from_dict(
        {
            "model": {"preset": "qwen3-vl-4b"},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 8},
            "parallel": {"dp": 8, "zero_stage": 3, "micro_batch_size": 1, "global_batch_size": 8},
            "training": {"fused_kernels": False, "dtensor_dispatch": "eager"},
            "multimodal": {"images_per_sample": 1, "image_tokens": 575, "text_tokens": 32},
        }
    )
    v, mm, plan, gpu = spec.vision, spec.multimodal, spec.plan(), spec.cluster.gpu
    assert v is not None and mm is not None
    block = fsdp_host.gather_host_s(encoder_host.BLOCK_TENSORS)
    trained = encoder_host.fsdp_gather_host_s(v, mm, plan, spec.training, gpu)
    assert trained == pytest.approx((v.num_layers * block, v.num_layers * block))
    frozen_mm = dataclasses.replace(mm, freeze_encoder=True)
    frozen = encoder_host.fsdp_gather_host_s(v, frozen_mm, plan, spec.training, gpu)
    assert frozen == pytest.approx((v.num_layers * block, 0.0))
    cpu = cpu_host_spec(10.0).cluster.gpu
    assert encoder_host.fsdp_gather_host_s(v, mm, plan, spec.training, cpu) == (0.0, 0.0)
