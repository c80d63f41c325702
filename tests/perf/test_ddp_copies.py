"""PyTorch DDP's gradient copies as the trainer runs ZeRO 0 on data parallelism alone
(perf/step/dp_comm.py ``_ddp_copies``): each gradient copied into its bucket (divided by the
ranks on the way) and the all-reduced bucket copied back, in the synchronising micro-batch only.
Counted on the trainer's own step on two gloo ranks with a dispatch mode (no mocks)."""

from __future__ import annotations

import dataclasses

import pytest
from cpu_host_spec import cpu_host_spec as _spec

from aihpc.perf.step import dp_comm
from aihpc.perf.step.dtensor_host import stage_tensors
from aihpc.perf.step.estimate import estimate_plan
from aihpc.perf.step.params import DEFAULT_PARAMS

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module", params=[1, 2])
def counted(request) -> tuple[int, dict]:
    from cpu_cost_workers import ddp_copies

    from aihpc.bench.dist import launch_local

    return request.param, launch_local(2, ddp_copies, request.param)


def test_each_gradient_is_copied_into_its_bucket_and_back_once_a_step(counted) -> None:
    """One copy out of and one into every gradient, whatever the micro-batches (the reducer
    runs in the synchronising one): DDP_COPY_PASSES x the gradients' bytes read and written,
    in 2 x the stage's tensors copies."""
    _, c = counted
    assert c["ddp"] == "DistributedDataParallel"
    assert len(c["into"]) == len(c["out_of"]) == c["tensors"]
    assert sum(c["into"]) == sum(c["out_of"]) == c["param_bytes"]  # fp32 gradients
    read_and_written = 2 * sum(c["into"]) + 2 * sum(c["out_of"])
    assert read_and_written == dp_comm.DDP_COPY_PASSES * c["param_bytes"]
    tensors, _ = stage_tensors(4, 1, False)  # tiny-llama-small: 4 layers, untied
    assert tensors == c["tensors"]


def _dp_comm(spec) -> float:
    return estimate_plan(spec.model, spec.cluster, spec.plan(), spec.training).time_s["dp_comm"]


def test_the_step_pays_the_copies_at_the_memory_bandwidth(counted) -> None:
    """Halving the memory bandwidth adds the counted bytes once more to DDP's term (the
    all-reduce does not read it). The model's gradients are the trainer's but for the final
    norm's weight (hidden size 256, fp32), which it leaves out."""
    _, c = counted
    want = dp_comm.DDP_COPY_PASSES * (c["param_bytes"] - 256 * 4)
    eff = DEFAULT_PARAMS.hbm_efficiency
    fast, slow = _dp_comm(_spec(20.0, zero_stage=0)), _dp_comm(_spec(10.0, zero_stage=0))
    assert slow - fast == pytest.approx(want / (eff * 10e9) - want / (eff * 20e9), rel=1e-6)


def test_megatron_style_ddp_and_fsdp2_plans_have_no_ddp_copies() -> None:
    """Megatron-Core's DDP reduces its contiguous buffer in place (dtensor_dispatch not eager),
    and the trainer's non-DDP plans run FSDP2 (priced by fsdp_host): no DDP copies."""
    spec = _spec(20.0, "none", zero_stage=0)
    slow = dataclasses.replace(spec.cluster.gpu, hbm_bw_GBps=10.0)
    spec_slow = dataclasses.replace(spec, cluster=dataclasses.replace(spec.cluster, gpu=slow))
    assert _dp_comm(spec) == _dp_comm(spec_slow)
    # context parallel at ZeRO 0: its gradients all-reduced over the cp ranks, by FSDP2
    cp, cp_slow = _spec(20.0, zero_stage=0, cp=2), _spec(10.0, zero_stage=0, cp=2)
    assert _dp_comm(cp) > 0 and _dp_comm(cp) == _dp_comm(cp_slow)
