"""Eager DTensor's host time (perf/step/dtensor_host.py): the op counts it prices are the trainer's
own, counted on a real one-rank gloo mesh; the estimate adds exactly counted ops x the cost per
op where the host is the device, hides it behind a GPU's kernels where they take longer, and
leaves every spec without ``dtensor_dispatch = "eager"`` alone."""

from __future__ import annotations

import dataclasses

import pytest

from aihpc.perf.step import dtensor_host as dh
from aihpc.perf.step.estimate import estimate_plan
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec import runspec_from_dict
from aihpc.runspec.calibration import calibration_from_dict, calibration_to_toml, load_calibration
from aihpc.runspec.cluster import GPUSpec
from aihpc.runspec.errors import SpecError

CPU = GPUSpec(1.0, 64.0, 10.0, 1.0, 2, 1.0, fp32_tflops=1.0, host_is_device=True)
GPU = dataclasses.replace(CPU, host_is_device=False)


@pytest.fixture(scope="module")
def counted() -> dict:
    pytest.importorskip("torch")
    from aihpc.bench.dtensor_host import count_trainer_ops

    return count_trainer_ops()


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("layers", [1, 2])
def test_the_priced_op_counts_are_the_trainers(counted: dict, layers: int, sp: bool) -> None:
    got = counted[f"{layers} {sp}"]
    assert got["fwd"] == dh.OUTSIDE_FWD_OPS + layers * dh.LAYER_FWD_OPS
    assert got["bwd"] == dh.OUTSIDE_BWD_OPS + layers * dh.LAYER_BWD_OPS[sp]
    tensors = dh.stage_tensors(layers, 1, tied=False)
    assert got["tensors"] == tensors[0]
    assert got["optimizer"] == dh.optimizer_ops(tensors, 2, sp, CPU)


def _spec(tp: int = 2, sp: bool = False, **parallel) -> object:
    return runspec_from_dict(
        {
            "model": {"preset": "tiny-llama-small"},
            "cluster": {"gpu_spec": dataclasses.asdict(CPU), "num_gpus": 2, "gpus_per_node": 2},
            "parallel": {"tp": tp, "sequence_parallel": sp, "micro_batch_size": 4,
                         "global_batch_size": 8, **parallel},
        }
    )  # fmt: skip


def _step(spec, dispatch: str, op_us: float | None = None, gpu: GPUSpec = CPU) -> float:
    cal = calibration_from_dict({"dtensor_op_us": op_us}) if op_us is not None else None
    cluster = dataclasses.replace(spec.cluster, gpu=gpu, calibration=cal)
    training = dataclasses.replace(spec.training, dtensor_dispatch=dispatch)
    return estimate_plan(spec.model, cluster, spec.plan(), training).step_time_s


@pytest.mark.parametrize("sp", [False, True])
def test_on_a_cpu_the_step_pays_every_counted_op(sp: bool) -> None:
    spec = _spec(sp=sp)
    layers, micro = spec.model.num_layers, 2  # global 8 / micro-batch 4, one data-parallel rank
    per_micro = dh.OUTSIDE_FWD_OPS + dh.OUTSIDE_BWD_OPS
    per_micro += layers * (dh.LAYER_FWD_OPS + dh.LAYER_BWD_OPS[sp])
    ops = micro * per_micro + dh.optimizer_ops(dh.stage_tensors(layers, 1, False), 2, sp, CPU)
    extra = _step(spec, "eager", 40.0) - _step(spec, "none", 40.0)
    assert extra == pytest.approx(ops * 40e-6, rel=1e-9)
    # without a measurement the model's constant prices the same ops
    default = _step(spec, "eager") - _step(spec, "none")
    assert default == pytest.approx(ops * DEFAULT_PARAMS.dtensor_op_s, rel=1e-9)


def test_which_plans_hold_dtensors() -> None:
    # (tp, dp, cp, pp, zero, ep) -> DTensor parameters (runtime/parallelize.py's choice)
    cases = {
        (1, 1, 1, 1, 0, 1): False,  # one rank
        (1, 2, 1, 1, 0, 1): False,  # DDP
        (1, 2, 1, 1, 3, 1): True,  # FSDP2
        (1, 2, 1, 1, 1, 1): True,
        (1, 1, 2, 1, 0, 1): True,  # context parallel: FSDP2 replicas over dp x cp
        (1, 1, 1, 2, 0, 1): False,  # pipeline alone: one data-parallel rank per stage
        (2, 1, 1, 1, 0, 1): True,  # tensor parallel
        (1, 2, 1, 1, 0, 2): True,  # experts over EP: FSDP2, not DDP
    }
    for key, want in cases.items():
        assert bool(dh.dtensor_params(*key)) is want, key
    # a plan without DTensors pays no DTensor op, whatever one costs: only the layers of a
    # tensor-parallel plan run ops on DTensors, and DDP's parameters are plain tensors (under
    # the trainer's eager PyTorch DDP it pays its gradient copies: tests/perf/test_ddp_copies)
    ddp = _spec(tp=1, zero_stage=0)
    assert _step(ddp, "eager", 40.0) == _step(ddp, "eager", 80.0)


def test_fsdp_pays_the_optimizer_ops_and_its_copies() -> None:
    """Under FSDP2 alone the DTensor ops are the optimizer's: each measured microsecond costs
    them once; eager FSDP2 also pays its copies (perf/step/fsdp_host.py, counted in
    tests/perf/test_fsdp_host.py), whatever an op costs."""
    fsdp = _spec(tp=1, zero_stage=3)
    layers = fsdp.model.num_layers
    ops = dh.optimizer_ops(dh.stage_tensors(layers, 1, False), 1, False, CPU)
    assert ops == 7 * (9 * layers + 3) + 7 * layers + 2 + 4  # one gradient group to clip
    extra = _step(fsdp, "eager", 80.0) - _step(fsdp, "eager", 40.0)
    assert extra == pytest.approx(ops * 40e-6, rel=1e-9)
    copies = _step(fsdp, "eager", 40.0) - _step(fsdp, "none", 40.0) - ops * 40e-6
    assert copies > 0


def test_on_a_gpu_the_host_runs_ahead_of_longer_kernels() -> None:
    spec = _spec()
    cpu_extra = _step(spec, "eager", 40.0) - _step(spec, "none", 40.0)
    # the same part as a GPU: the host issues ahead, and a pass costs more only where its
    # kernels take less than the host; this part's kernels take longer than 40 us per op
    gpu_extra = _step(spec, "eager", 40.0, GPU) - _step(spec, "none", 40.0, GPU)
    assert 0 <= gpu_extra < cpu_extra
    assert _step(spec, "eager", 0.001, GPU) == _step(spec, "none", 0.001, GPU)
    # a host far slower than the kernels shows through
    assert _step(spec, "eager", 1e5, GPU) > _step(spec, "none", 1e5, GPU)
    assert dh.host_excess_s(1.0, 10, 0.01, GPU) == 0.0  # 0.1 s to issue 1 s of kernels
    assert dh.host_excess_s(1.0, 10, 0.2, GPU) == pytest.approx(1.0)  # 2 s to issue them
    assert dh.host_excess_s(1.0, 10, 0.01, CPU) == pytest.approx(0.1)


def test_the_calibration_carries_the_measurement(tmp_path) -> None:
    cal = calibration_from_dict({"dtensor_op_us": 45.5})
    path = tmp_path / "cal.toml"
    path.write_text(calibration_to_toml(cal))
    assert load_calibration(path).dtensor_op_us == 45.5
    with pytest.raises(SpecError, match=r"calibration\.dtensor_op_us"):
        calibration_from_dict({"dtensor_op_us": -1})
    with pytest.raises(SpecError, match=r"training\.dtensor_dispatch"):
        runspec_from_dict(
            {
                "model": {"preset": "tiny-llama-small"},
                "cluster": {"gpu": "h100-sxm", "num_gpus": 1},
                "training": {"dtensor_dispatch": "compiled"},
            }
        )


@pytest.mark.parametrize("gpu", ["h100-sxm", "local cpu"])
def test_the_search_prices_eager_dtensor_as_estimate_does(gpu: str) -> None:
    # every plan the array search prices (tp, FSDP2, DDP, pp, cp mixed) at estimate_plan's step
    from aihpc.perf.search.ranking import search

    cluster = {"gpu": "h100-sxm"} if gpu == "h100-sxm" else {"gpu_spec": dataclasses.asdict(CPU)}
    spec = runspec_from_dict(
        {
            "model": {"preset": "tiny-llama-small"},
            "cluster": {**cluster, "num_gpus": 8, "gpus_per_node": 8},
            "parallel": {"global_batch_size": 16},
            "training": {"dtensor_dispatch": "eager"},
        }
    )
    result = search(spec, top=None)
    assert len(result.plans) > 20
    for est in result.plans:
        one = estimate_plan(spec.model, spec.cluster, est.plan, spec.training)
        assert est.step_time_s == pytest.approx(one.step_time_s, rel=1e-12)
    plain = dataclasses.replace(spec.training, dtensor_dispatch="none")
    tp = next(e for e in result.plans if e.plan.tp > 1)
    assert tp.step_time_s > estimate_plan(spec.model, spec.cluster, tp.plan, plain).step_time_s


def test_the_optimizers_ops_are_priced_at_the_optimizers_measurement(tmp_path) -> None:
    """With ``dtensor_optimizer_op_us`` the optimizer's counted DTensor ops cost that figure
    and the layers' keep ``dtensor_op_us``; the file carries it."""
    spec = _spec()
    layers = spec.model.num_layers
    opt_ops = dh.optimizer_ops(dh.stage_tensors(layers, 1, False), 2, False, CPU)

    def step(cal: dict) -> float:
        cluster = dataclasses.replace(spec.cluster, calibration=calibration_from_dict(cal))
        training = dataclasses.replace(spec.training, dtensor_dispatch="eager")
        return estimate_plan(spec.model, cluster, spec.plan(), training).step_time_s

    layer_only = step({"dtensor_op_us": 40.0})
    both = step({"dtensor_op_us": 40.0, "dtensor_optimizer_op_us": 25.0})
    assert layer_only - both == pytest.approx(opt_ops * 15e-6, rel=1e-9)
    cal = calibration_from_dict({"dtensor_op_us": 40.0, "dtensor_optimizer_op_us": 25.0})
    path = tmp_path / "cal.toml"
    path.write_text(calibration_to_toml(cal))
    assert load_calibration(path).dtensor_optimizer_op_us == 25.0
    with pytest.raises(SpecError, match=r"calibration\.dtensor_optimizer_op_us"):
        calibration_from_dict({"dtensor_optimizer_op_us": -1})
