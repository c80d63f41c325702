"""Host time to issue a decoder layer's kernels, eager or compiled, in seconds.

A GPU runs a layer no faster than its host issues it. Eager PyTorch (``training.fused_kernels``
false: aihpc's own trainer without compile) issues every op from Python, one dispatcher call
and, for an op that computes, one kernel launch each: a small micro-batch's layer then waits on
its host (the issue's H200 runs: 687 ms measured against 257 ms priced at micro-batch 1).
``torch.compile`` (``training.compile``) replaces the layer's ops by Inductor's generated
kernels, fused element-wise, launched one by one from its wrapper, with the GEMMs and the
attention kernel as external calls. Megatron-Core and Transformer Engine layers (fused kernels,
no compile) are not priced here, nor are CUDA graphs (``cuda_graphs`` full / partial).

The ops are counted, not fitted: ``tests/perf/test_host_issue.py`` counts the aten ops of
runtime/model.py's dense decoder layer under bf16 autocast (as the trainer runs it on a GPU)
with a dispatch mode and checks them against the constants below (torch 2.13). The compiled
counts are Inductor's generated kernels for the same layer (``torch._inductor.metrics``,
forward 17, backward 11, measured once on the CPU backend with torch 2.13) plus the external
calls (7 GEMMs forward, 14 backward, one attention kernel each way): the GPU backend fuses
differently, which ``benchmarks/gpu_checks.sh`` measures against this price.

Each op that launches a kernel costs ``params.host_eager_op_s`` of host time (the Python call,
the dispatcher, the launch; also what one launch from Inductor's Python wrapper is priced at);
each view or metadata op ``params.host_op_overhead_s`` (no launch). On a GPU the layer costs
max(kernels, host) (``dtensor_host.host_excess_s``), with the eager tensor-parallel DTensor
dispatch of dtensor_host.py added to the same host time, which compile traces away inside the
blocks. Where the host is the device (a CPU) the ops run on the issuing thread, so their host
time adds to the kernels' in full: an eager layer's fp32 ops as eager_host.py counts them (no
autocast casts there), a compiled layer's launches as above.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from aihpc.perf.step import dtensor_host, eager_host, fsdp_host
from aihpc.perf.step.params import ModelParams
from aihpc.runspec.calibration import Calibration
from aihpc.runspec.cluster import GPUSpec
from aihpc.runspec.host_cpu import host_cpu_ratio
from aihpc.runspec.parallel import ParallelPlan
from aihpc.runspec.training import TrainingSpec

__all__ = [
    "COMPILED_BWD_LAUNCHES",
    "COMPILED_FWD_LAUNCHES",
    "EAGER_BWD_OPS",
    "EAGER_FWD_OPS",
    "issue_host_s",
    "layer_issue_s",
    "with_host_time",
]

# One dense decoder layer, one micro-batch, bf16 autocast, torch 2.13: (ops that launch a
# kernel, views and other metadata ops). Forward: 7 GEMMs, the attention kernel, the norms'
# fp32 pow / mean / rsqrt / multiplies, RoPE's float multiply-and-stack, SwiGLU, the residual
# adds and autocast's 16 casts; backward: their gradients (14 GEMMs).
EAGER_FWD_OPS = (55, 44)
EAGER_BWD_OPS = (91, 75)
# The same layer compiled: Inductor's generated kernels plus the external GEMM and attention
# calls (module docstring).
COMPILED_FWD_LAUNCHES = 17 + 7 + 1
COMPILED_BWD_LAUNCHES = 11 + 14 + 1


def issue_host_s(training: TrainingSpec, params: ModelParams) -> tuple[float, float]:
    """(forward, backward) host seconds for a GPU's host to issue one dense layer's kernels for
    one micro-batch under bf16 autocast: compiled (``training.compile``), eager
    (``eager_host.eager``: unfused, no CUDA graphs), else 0 (not priced)."""
    launch, view = params.host_eager_op_s, params.host_op_overhead_s
    if training.compile:
        return COMPILED_FWD_LAUNCHES * launch, COMPILED_BWD_LAUNCHES * launch
    if eager_host.eager(training):
        return tuple(ops * launch + views * view for ops, views in (EAGER_FWD_OPS, EAGER_BWD_OPS))
    return 0.0, 0.0


def layer_issue_s(
    training: TrainingSpec,
    params: ModelParams,
    gpu: GPUSpec,
    local_experts: float | None = None,
    cp: int = 1,
) -> tuple[float, float]:
    """(forward, backward) host issue of one layer and micro-batch on ``gpu``: where the host is
    the device (a CPU: fp32, no autocast) the compiled launches or the eager ops counted by
    eager_host.py (an MoE layer's own, with ``local_experts`` experts on the rank; the ring
    attention's under ``cp`` > 1); on a GPU ``issue_host_s`` (a dense layer's) times the GPU's
    host's time per eager call over the x86 host it was measured on (runspec/host_cpu.py)."""
    if gpu.host_is_device and not training.compile:
        return eager_host.layer_host_s(training, params, local_experts, cp)
    fwd, bwd = issue_host_s(training, params)
    ratio = host_cpu_ratio(gpu.id)
    return fwd * ratio, bwd * ratio


def with_host_time(
    lt: Any,
    gpu: GPUSpec,
    plan: ParallelPlan,
    training: TrainingSpec,
    params: ModelParams,
    calibration: Calibration | None,
    moe_priced: bool = False,
    local_experts: float | None = None,
) -> Any:
    """``lt`` (compute.LayerTimes) with what its host adds: the kernels' issue (none where
    ``moe_priced``: moe_host.py priced an eager MoE layer's own ops) and, for an eager
    tensor-parallel layer not compiled, DTensor's dispatch (dtensor_host.py); all of it where the
    host is the device, else what it takes beyond the layer's kernels. ``local_experts``: an
    MoE layer with that many experts on the rank (its own eager ops on a CPU)."""
    issue = layer_issue_s(training, params, gpu, local_experts, plan.cp)
    fwd, bwd = (0.0, 0.0) if moe_priced else issue
    if training.dtensor_dispatch == "eager" and plan.tp > 1 and not training.compile:
        op_s = dtensor_host.dtensor_op_s(params, calibration)
        fwd += dtensor_host.LAYER_FWD_OPS * op_s
        bwd += dtensor_host.LAYER_BWD_OPS[plan.sequence_parallel] * op_s
    if training.dtensor_dispatch == "eager" and not gpu.host_is_device:
        # FSDP2's host work around each layer unit's all-gathers (fsdp_host.gather_host_s); on
        # a CPU host the calibration's collectives hold what the hooks cost there
        wrapped = fsdp_host.fsdp_wrapped(
            plan.tp, plan.dp, plan.cp, plan.pp, plan.zero_stage, plan.ep
        )
        if bool(wrapped):
            g_f, g_b = fsdp_host.unit_gathers(plan.zero_stage, plan.pp)
            hook = fsdp_host.gather_host_s(dtensor_host.TENSORS_PER_LAYER)
            fwd, bwd = fwd + g_f * hook, bwd + g_b * hook
    if not (fwd or bwd):
        return lt
    fwd_x = eager_host.pass_excess_s(lt.fwd, fwd, gpu)
    bwd_x = eager_host.pass_excess_s(lt.bwd, bwd, gpu)
    return replace(lt, fwd_host=lt.fwd_host + fwd_x, bwd_host=lt.bwd_host + bwd_x)
