"""Estimate one plan: memory, step time split into compute / communication / bubble, MFU.

The estimate is a pure function of (ModelSpec, ClusterSpec, ParallelPlan, TrainingSpec) and the
model constants (``ModelParams``); the calibration in ClusterSpec overrides measured figures. The
step is a sum of named terms (batch_step.py, dp_comm.py; per shape batch_shapes.py) and the
memory a breakdown of named parts (batch_memory.py), the functions the search runs over arrays
of plans, here on one plan's numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from aihpc.perf.step.batch_memory import memory_breakdown
from aihpc.perf.step.batch_shapes import Shapes
from aihpc.perf.step.batch_step import StepTerms
from aihpc.perf.step.flops import (
    counted_keys,
    layer_flops,
    layer_gemms,
    model_flops_per_token,
    op_sac_saved,
)
from aihpc.perf.step.memory import GiB, MemoryBreakdown
from aihpc.perf.step.param_counts import ParamCounts, param_counts
from aihpc.perf.step.params import DEFAULT_PARAMS, ModelParams
from aihpc.perf.step.plan_batch import PlanBatch
from aihpc.runspec.cluster import ClusterSpec
from aihpc.runspec.errors import SpecError
from aihpc.runspec.model import ModelSpec
from aihpc.runspec.parallel import ParallelPlan, validate_plan
from aihpc.runspec.runspec import RunSpec
from aihpc.runspec.training import TrainingSpec

__all__ = ["Estimate", "estimate", "estimate_plan", "step_terms", "tokens_per_s_per_gpu"]


@dataclass(frozen=True)
class Estimate:
    plan: ParallelPlan
    fits: bool
    step_time_s: float
    tokens_per_s_per_gpu: float
    model_tflops_per_gpu: float
    mfu: float
    hfu: float
    memory: MemoryBreakdown
    time_s: dict[str, float]
    hbm_gib: float
    moe: bool = False
    host_mem_gib: float | None = None  # host memory per GPU, for offloaded activations
    precision: str = "bf16"  # the run's; MFU is over the part's dense peak at it
    peak_tflops: float = 0.0  # that peak
    bf16_peak_tflops: float = 0.0  # the part's BF16 dense peak, on which Megatron and NeMo quote
    hidden_s: dict[str, float] = field(default_factory=dict)  # communication hidden, per step
    params: ParamCounts | None = None
    headroom_gib: float = 0.0  # GPU memory the plan must leave free ([cluster] / --headroom-gib)

    @property
    def bottleneck(self) -> str:
        """The step's largest loss (or why the plan does not fit), in one sentence."""
        text = _bottleneck(
            self.time_s,
            self.step_time_s,
            self.memory,
            self.hbm_gib - self.headroom_gib,
            self.host_mem_gib,
        )
        return text

    def to_json(self) -> dict[str, Any]:
        out = {
            "fits": self.fits,
            "step_time_s": self.step_time_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "memory_gib": self.memory.gib(),
            "host_offload_gib": self.memory.offloaded / GiB,
            "gradients_after_peak_gib": self.memory.gradients_after_peak / GiB,
            "time_s": dict(self.time_s),
            "plan": self.plan.as_dict(),
            "bottleneck": self.bottleneck,
            # the peak MFU is over, and MFU over the BF16 peak (FP8 runs; Megatron's and NeMo's
            # convention), so a reader never compares an FP8-peak MFU with a BF16-peak one
            "mfu_peak": {"precision": self.precision, "tflops": self.peak_tflops},
            "mfu_bf16_peak": self.model_tflops_per_gpu / self.bf16_peak_tflops
            if self.bf16_peak_tflops
            else None,
            "hidden_s": dict(self.hidden_s),
        }
        if self.params is not None:
            out["params"] = self.params.to_json()
        return out


def estimate_plan(
    model: ModelSpec,
    cluster: ClusterSpec,
    plan: ParallelPlan,
    training: TrainingSpec,
    params: ModelParams = DEFAULT_PARAMS,
    check: bool = True,
    memo: dict[tuple, Any] | None = None,
) -> Estimate:
    """Estimate a complete plan. ``check=False`` skips the divisibility checks (search did them).

    ``memo``: a dict shared across calls with the same model, cluster, training and params (the
    search passes one); the figures of a (tp, cp, micro-batch, SP, ep, etp) shape and the
    collectives' times are kept in it.

    The step time is the sum of the named terms of ``batch_step.StepTerms``, the same functions
    the search prices arrays of plans with, here on this one plan's numbers.
    """
    if check:
        _check(model, cluster, plan, training)
    terms = _terms(model, cluster, plan, training, params, memo)
    raw, step_raw = terms.terms()
    time_s, step = {k: float(v) for k, v in raw.items()}, float(step_raw)
    est = _estimate(model, cluster, plan, training, params, time_s, step, memo)
    hidden = {k: float(v) for k, v in terms.hidden_s.items()}
    return replace(est, hidden_s=hidden, params=param_counts(model, plan))


def step_terms(
    model: ModelSpec,
    cluster: ClusterSpec,
    plan: ParallelPlan,
    training: TrainingSpec,
    params: ModelParams = DEFAULT_PARAMS,
    memo: dict[tuple, Any] | None = None,
) -> tuple[dict[str, float], float]:
    """(the step's terms, as ``Estimate.time_s``; the step time) of one plan, unchecked: the
    step time alone, for callers that need no memory (fits to measured runs)."""
    time_s, step = _terms(model, cluster, plan, training, params, memo).terms()
    return {k: float(v) for k, v in time_s.items()}, float(step)


def _terms(
    model: ModelSpec,
    cluster: ClusterSpec,
    plan: ParallelPlan,
    training: TrainingSpec,
    params: ModelParams,
    memo: dict[tuple, Any] | None,
) -> StepTerms:
    b = PlanBatch.of(plan)
    shapes = Shapes(b, model, cluster, training, params, memo)
    return StepTerms(model, cluster, training, params, b, shapes, memo)


def tokens_per_s_per_gpu(
    model: ModelSpec, cluster: ClusterSpec, plan: ParallelPlan, step_time_s: float
) -> float:
    """Tokens per second per GPU of a plan whose step takes ``step_time_s``."""
    return plan.global_batch_size * model.seq_length / step_time_s / cluster.num_gpus


def _check(
    model: ModelSpec, cluster: ClusterSpec, plan: ParallelPlan, training: TrainingSpec
) -> None:
    """The divisibility checks, and what the training options refuse."""
    validate_plan(plan, model, cluster)
    chunks = plan.pp * plan.vpp
    if training.pipeline_split == "even" and plan.pp > 1 and model.num_layers % chunks:
        raise SpecError(
            "parallel.vpp" if plan.vpp > 1 else "parallel.pp",
            plan.vpp if plan.vpp > 1 else plan.pp,
            f"training.pipeline_split = even needs pp x vpp = {chunks} to divide "
            f"num_layers {model.num_layers}",
        )
    if training.zero3_gather == "per_tensor" and plan.zero_stage == 3 and plan.pp > 1:
        raise SpecError(
            "training.zero3_gather",
            "per_tensor",
            "DeepSpeed's per-tensor ZeRO-3 has no pipeline parallelism: pp = 1, or bucketed",
        )


def _estimate(
    model: ModelSpec,
    cluster: ClusterSpec,
    plan: ParallelPlan,
    training: TrainingSpec,
    params: ModelParams,
    time_s: dict[str, float],
    step: float,
    memo: dict[tuple, Any] | None,
) -> Estimate:
    """Throughput, utilisation and memory of a plan whose step is priced."""
    tokens_step = plan.global_batch_size * model.seq_length
    flops = memo.get(("token_flops", plan.recompute)) if memo is not None else None
    if flops is None:
        flops = _token_flops(model, plan.recompute)
        if memo is not None:
            memo[("token_flops", plan.recompute)] = flops
    flops_step = flops[0] * tokens_step
    recompute_flops = flops[1] * tokens_step
    gpu = cluster.gpu
    per_gpu = flops_step / step / cluster.num_gpus
    peak = gpu.peak_tflops(training.precision) * 1e12
    mem = memory_breakdown(model, cluster, plan, training, params)
    hbm = gpu.hbm_gib
    host = gpu.host_mem_gib
    host_ok = host is None or mem.offloaded <= host * GiB
    return Estimate(
        plan=plan,
        fits=mem.total <= cluster.usable_hbm_gib * GiB and host_ok,
        step_time_s=step,
        tokens_per_s_per_gpu=tokens_per_s_per_gpu(model, cluster, plan, step),
        model_tflops_per_gpu=per_gpu / 1e12,
        mfu=per_gpu / peak,
        hfu=(flops_step + recompute_flops) / step / cluster.num_gpus / peak,
        memory=mem,
        time_s=time_s,
        hbm_gib=hbm,
        moe=model.is_moe,
        host_mem_gib=host,
        precision=training.precision,
        peak_tflops=peak / 1e12,
        bf16_peak_tflops=gpu.bf16_tflops or 0.0,
        headroom_gib=cluster.memory_headroom_gib,
    )


def _token_flops(model: ModelSpec, recompute: str) -> tuple[float, float]:
    """Model FLOPs per token, and the FLOPs per token the recompute policy runs again."""
    s = counted_keys(model, model.seq_length)
    if recompute == "full":
        again = model.num_layers * layer_flops(model, 1, s).total
    elif recompute == "selective":
        again = model.num_layers * layer_flops(model, 1, s).attn_core
    elif recompute == "op":
        unsaved = sum(
            2 * n_in * n_out
            for i, (_, n_in, n_out, _) in enumerate(layer_gemms(model))
            if not op_sac_saved(i)
        )
        again = model.num_layers * unsaved
    else:
        again = 0.0
    return model_flops_per_token(model), again


def _bottleneck(
    time_s: dict[str, float],
    step: float,
    mem: MemoryBreakdown,
    hbm: float,
    host: float | None = None,
) -> str:
    if host is not None and mem.offloaded > host * GiB:
        return (
            f"Does not fit: {mem.offloaded / GiB:.1f} GiB of offloaded activations vs "
            f"{host:.0f} GiB of host memory per GPU."
        )
    if mem.total > hbm * GiB:
        parts = {k: v for k, v in mem.gib().items() if k != "total"}
        worst = max(parts, key=parts.get)  # type: ignore[arg-type]
        return (
            f"Does not fit: {mem.total / GiB:.1f} GiB needed on the {mem.stage} stage vs "
            f"{hbm:.0f} GiB, mostly {worst} ({parts[worst]:.1f} GiB)."
        )
    overhead = {k: v for k, v in time_s.items() if k != "compute"}
    worst = max(overhead, key=overhead.get)  # type: ignore[arg-type]
    share = overhead[worst] / step
    label = {
        "recompute": "activation recompute",
        "tp_comm": "exposed tensor-parallel communication",
        "cp_comm": "exposed context-parallel communication",
        "ep_comm": "exposed expert-parallel all-to-all (dispatch and combine)",
        "pp_comm": "pipeline point-to-point transfers",
        "dp_comm": "exposed data-parallel gradient/parameter communication",
        "pipeline_bubble": "the pipeline bubble",
        "optimizer": "the optimizer step",
        "offload": "activation copies to and from host memory",
    }[worst]
    if share < 0.05:
        return f"Compute-bound: {time_s['compute'] / step:.0%} of the step is useful compute."
    return f"The largest loss is {label}: {share:.0%} of the step."


def estimate(
    spec: RunSpec, plan: ParallelPlan | None = None, params: ModelParams = DEFAULT_PARAMS
) -> Estimate:
    """Estimate the run spec's plan (or ``plan``)."""
    return estimate_plan(spec.model, spec.cluster, plan or spec.plan(), spec.training, params)
