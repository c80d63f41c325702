"""What a launch reports at its end beside what it trained: the plan as laid out over the ranks,
the Slurm job it ran in and how often Slurm had requeued it, and the measured step time and MFU
against ``aihpc estimate``'s prediction for the same spec with this trainer's software facts, on
the machine the launch ran on (the spec's GPU, or this host as ``aihpc calibrate --local``
measured it; none, said so, where neither describes it: an H100's step time beside a CPU's read
"-100%").
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aihpc.runspec import RunSpec, SpecError, load_runspec
from aihpc.runspec.cluster import GPUSpec

if TYPE_CHECKING:
    from aihpc.runtime.mesh import Parallel

__all__ = [
    "as_trained",
    "device_label",
    "measured_vs_predicted",
    "plan_summary",
    "slurm_job",
    "spec_for_this_machine",
]


def as_trained(spec: RunSpec) -> RunSpec:
    """``spec`` with the software facts of this trainer, which the prediction beside its
    measurement must price: eager PyTorch, one kernel per element-wise op (``fused_kernels``
    false: no torch.compile, RMSNorm and RoPE in fp32 as runtime/model.py writes them), and
    ``F.cross_entropy`` on fp32-upcast logits (``cross_entropy`` eager, runtime/step.py),
    DTensor's tensor-parallel collectives issued and waited for in line (``tp_comm_overlap``
    none), every op on a DTensor (tensor-parallel layers, loss parallel, the optimizer on
    DTensor parameters) dispatched eagerly in Python (``dtensor_dispatch`` eager), and under
    context parallelism the ring's attention blocks as matmuls over materialised scores
    (``attention`` unfused, comm/ring.py). With ``training.compile`` the blocks' element-wise
    ops are fused by Inductor (``fused_kernels`` true), and the host's issue of the compiled
    kernels is priced instead of the eager ops' (perf/step/host_issue.py)."""
    training = dataclasses.replace(
        spec.training,
        fused_kernels=spec.training.compile,
        cross_entropy="eager",
        tp_comm_overlap="none",
        dtensor_dispatch="eager",
        attention="unfused" if spec.plan().cp > 1 else spec.training.attention,
    )
    return dataclasses.replace(spec, training=training)


def device_label(device: Any) -> str:
    """What a launch ran on, as the summary names it: "cpu", or the CUDA device's name."""
    if device.type != "cuda":
        return device.type
    import torch

    return torch.cuda.get_device_name(device)


def _describes(gpu: GPUSpec, device: str) -> bool:
    """Whether a spec's GPU is the device a launch ran on: on a CPU, a host measured by
    ``aihpc calibrate --local`` (``host_is_device``); on a GPU, a catalog part whose family
    (h100, a100, mi300x, ...) the device's name carries, or a gpu_spec of its own that names
    the device (``calibrate --local`` on a GPU) or names nothing (nothing to tell it by)."""
    if device == "cpu" or gpu.host_is_device:
        return device == "cpu" and gpu.host_is_device
    name = device.lower()
    if gpu.id != "custom":
        return gpu.id.split("-")[0] in name
    return gpu.name == "custom" or name in gpu.name.lower()


def spec_for_this_machine(
    spec: RunSpec, device: str, world_size: int
) -> tuple[RunSpec | None, str | None]:
    """(the spec to price beside this launch's measurement, None) where one describes the
    device it ran on: the run spec itself, else its copy for this host that ``aihpc calibrate
    --local --spec SPEC`` writes, STEM.local.toml (beside the spec or in the current folder),
    with the spec's own model, plan and training; else (None, one sentence saying why there
    is no prediction for this machine and the command that makes one)."""
    if _describes(spec.cluster.gpu, device):
        return spec, None
    src = Path(spec.path or "SPEC.toml")
    name = src.stem + ".local.toml"
    found = [c for c in (src.parent / name, Path(name)) if spec.path and c.is_file()]
    gpu = spec.cluster.gpu
    why = f"{src} describes {gpu.id if gpu.id != 'custom' else gpu.name}"
    local = None
    if found:
        try:
            local = load_runspec(found[0])
        except SpecError as err:
            why = f"{found[0]} cannot be read ({err})"
    if local is not None and not _describes(local.cluster.gpu, device):
        why, local = f"{found[0]} describes {local.cluster.gpu.name}", None
    elif local is not None and local.cluster.num_gpus != world_size:
        why, local = f"{found[0]} measured it as {local.cluster.num_gpus} rank(s)", None
    if local is not None:
        return dataclasses.replace(spec, cluster=local.cluster, path=str(found[0])), None
    return None, (
        f"no prediction for this machine ({device}, {world_size} rank(s)): {why}; `aihpc "
        f"calibrate --local --nproc {world_size} --spec {src}` measures this host and writes "
        f"{name}, which the next `aihpc train` compares with"
    )


def measured_vs_predicted(
    spec: RunSpec, step_times: list[float], world_size: int, device: str = "cpu"
) -> dict[str, Any]:
    """This launch's measured step time (median over its steps after the first, which pays for
    allocations and first-touch communication) and MFU beside ``aihpc estimate``'s for the same
    spec with this trainer's software facts (``as_trained``), priced on the machine the launch
    ran on (``spec_for_this_machine``): ``prediction_for`` names the spec file priced, and
    where none describes this machine the prediction is null and ``no_prediction`` says why.
    MFU is over the priced spec's GPU peak; with no prediction, over the run spec's."""
    from aihpc.observe.metrics import predict

    timed = step_times[1:] or step_times
    measured_s = statistics.median(timed) if timed else None
    priced, why_not = spec_for_this_machine(spec, device, world_size)
    p = predict(as_trained(priced)) if priced is not None else None
    if priced is not None and p is None:
        why_not = f"no prediction: aihpc estimate cannot price {priced.path or 'the run spec'}"
    out: dict[str, Any] = {
        "measured_step_time_s": measured_s,
        "measured_steps": len(timed),
        "predicted_step_time_s": p.step_time_s if p else None,
        "measured_mfu": None,
        "predicted_mfu": p.mfu if p else None,
        "step_time_error": None,
        "device": device,
        "prediction_for": (priced.path or "the run spec") if p and priced else None,
        "no_prediction": why_not,
    }
    if measured_s:
        out["measured_mfu"] = _mfu(spec, p, measured_s * world_size)
    if p and measured_s:
        out["step_time_error"] = p.step_time_s / measured_s - 1.0
    return out


def _mfu(spec: RunSpec, p: Any, gpu_seconds: float) -> float | None:
    """Model FLOPs of one step over ``gpu_seconds`` at the peak of ``p``'s GPU, or with no
    prediction the run spec's (None where the spec's GPU has no peak at its precision)."""
    from aihpc.perf.step.flops import model_flops_per_token

    try:
        peak = p.peak_flops if p else spec.cluster.gpu.peak_tflops(spec.training.precision) * 1e12
    except SpecError:
        return None
    flops = p.model_flops_per_token if p else model_flops_per_token(spec.model)
    return flops * spec.plan().global_batch_size * spec.model.seq_length / (gpu_seconds * peak)


def plan_summary(par: Parallel) -> dict[str, Any]:
    d = par.dims
    return {
        "tp": d.tp,
        "pp": d.pp,
        "vpp": d.vpp,
        "cp": d.cp,
        "dp": d.dp,
        "dp_shard": d.dp_shard,
        "ep": d.ep,
        "sequence_parallel": d.sequence_parallel,
        "pp_schedule": d.pp_schedule if d.pp > 1 else None,
    }


def slurm_job(env: dict[str, str] | None = None) -> dict[str, Any]:
    """The Slurm job this launch ran in (``slurm_job_id``, None outside Slurm) and ``requeues``:
    how many times Slurm had requeued it before this launch (``SLURM_RESTART_COUNT``, Slurm's
    ``Restarts``, which ``aihpc launch --submit`` follows; preemption, ``scontrol requeue``, the
    batch script's own requeue at the time limit, a node failure). 0 outside Slurm."""
    env = os.environ if env is None else env
    count = env.get("SLURM_RESTART_COUNT", "")
    return {
        "requeues": int(count) if count.isdigit() else 0,
        "slurm_job_id": env.get("SLURM_JOB_ID") or None,
    }
