"""What a launch reports at its end beside what it trained: the plan as laid out over the ranks,
the Slurm job it ran in and how often Slurm had requeued it, and the measured step time and MFU
against ``aihpc estimate``'s prediction for the same spec with this trainer's software facts.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from typing import TYPE_CHECKING, Any

from aihpc.runspec import RunSpec

if TYPE_CHECKING:
    from aihpc.runtime.mesh import Parallel

__all__ = ["as_trained", "measured_vs_predicted", "plan_summary", "slurm_job"]


def as_trained(spec: RunSpec) -> RunSpec:
    """``spec`` with the software facts of this trainer, which the prediction beside its
    measurement must price: eager PyTorch, one kernel per element-wise op (``fused_kernels``
    false: no torch.compile, RMSNorm and RoPE in fp32 as runtime/model.py writes them), and
    ``F.cross_entropy`` on fp32-upcast logits (``cross_entropy`` eager, runtime/step.py),
    DTensor's tensor-parallel collectives issued and waited for in line (``tp_comm_overlap``
    none), every op on a DTensor (tensor-parallel layers, loss parallel, the optimizer on
    DTensor parameters) dispatched eagerly in Python (``dtensor_dispatch`` eager), and under
    context parallelism the ring's attention blocks as matmuls over materialised scores
    (``attention`` unfused, comm/ring.py)."""
    training = dataclasses.replace(
        spec.training,
        fused_kernels=False,
        cross_entropy="eager",
        tp_comm_overlap="none",
        dtensor_dispatch="eager",
        attention="unfused" if spec.plan().cp > 1 else spec.training.attention,
    )
    return dataclasses.replace(spec, training=training)


def measured_vs_predicted(
    spec: RunSpec, step_times: list[float], world_size: int
) -> dict[str, Any]:
    """This launch's measured step time (median over its steps after the first, which pays for
    allocations and first-touch communication) and MFU beside ``aihpc estimate``'s for the same
    spec with this trainer's software facts (``as_trained``). MFU is over the spec's GPU peak
    (``[cluster] gpu`` or ``gpu_spec``), so on a machine the spec does not describe it says how
    far the run is from the spec's hardware."""
    from aihpc.observe.metrics import predict

    timed = step_times[1:] or step_times
    measured_s = statistics.median(timed) if timed else None
    tokens = spec.plan().global_batch_size * spec.model.seq_length
    p = predict(as_trained(spec))
    out: dict[str, Any] = {
        "measured_step_time_s": measured_s,
        "measured_steps": len(timed),
        "predicted_step_time_s": p.step_time_s if p else None,
        "measured_mfu": None,
        "predicted_mfu": p.mfu if p else None,
        "step_time_error": None,
    }
    if p and measured_s:
        flops = p.model_flops_per_token * tokens
        out["measured_mfu"] = flops / (measured_s * world_size * p.peak_flops)
        out["step_time_error"] = p.step_time_s / measured_s - 1.0
    return out


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
