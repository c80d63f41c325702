"""The inference estimate of one batch on one serving plan: prefill of the batch's prompts,
decode steps at the batch's mean context, TTFT, TPOT, throughput, memory and the bottleneck.

    est = estimate_inference(model, gpu, batch=64, prompt_len=1024, output_len=256, tp=8)

``model`` is a run spec's ModelSpec; ``gpu`` its GPUSpec (a catalog part, or the host spec
`aihpc calibrate --local` writes) or its whole ClusterSpec (whose calibration and network
figures are then used).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from aihpc.perf.infer.comm import serving_cluster
from aihpc.perf.infer.kernels import Engine, Work
from aihpc.perf.infer.kv import ServingPlan
from aihpc.perf.infer.memory import InferenceMemory, inference_memory
from aihpc.perf.infer.software import DEFAULT_SOFTWARE, Software
from aihpc.perf.infer.step import StepTime, step_time
from aihpc.perf.step.params import DEFAULT_PARAMS, ModelParams
from aihpc.runspec.calibration import Calibration
from aihpc.runspec.cluster import ClusterSpec, GPUSpec
from aihpc.runspec.errors import SpecError
from aihpc.runspec.model import ModelSpec

__all__ = [
    "InferenceEstimate",
    "bottleneck_sentence",
    "engine_for",
    "estimate_inference",
    "weight_read_s",
]


@dataclass(frozen=True)
class InferenceEstimate:
    """One batch served on one plan. Times in seconds; throughput in output tokens."""

    plan: ServingPlan
    batch: int
    prompt_len: int
    output_len: int
    prefill_s: float  # the whole batch's prompts, one prefill
    decode_step_s: float  # one decode step of the whole batch at its mean context
    ttft_s: float
    tpot_s: float
    tokens_per_s_per_gpu: float
    tokens_per_s_per_request: float
    memory: InferenceMemory
    bottleneck: str
    prefill: StepTime
    decode: StepTime

    @property
    def gpus(self) -> int:
        return self.plan.gpus

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_s_per_gpu * self.gpus

    def to_json(self) -> dict[str, Any]:
        return {
            "plan": self.plan.to_json(),
            "batch": self.batch,
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
            "prefill_s": self.prefill_s,
            "decode_step_s": self.decode_step_s,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "tokens_per_s_per_request": self.tokens_per_s_per_request,
            "memory": self.memory.to_json(),
            "bottleneck": self.bottleneck,
            "prefill_terms": self.prefill.to_json(),
            "decode_terms": self.decode.to_json(),
        }


def _cluster(gpu: GPUSpec | ClusterSpec, gpus: int) -> tuple[ClusterSpec, Calibration | None]:
    if isinstance(gpu, ClusterSpec):
        base = serving_cluster(gpu.gpu, gpus)
        cluster = dataclasses.replace(
            gpu,
            num_gpus=base.num_gpus,
            gpus_per_node=base.gpus_per_node if gpu.num_gpus < gpus else gpu.gpus_per_node,
        )
        return cluster, gpu.calibration
    if not isinstance(gpu, GPUSpec):
        raise SpecError("gpu", type(gpu).__name__, "a GPUSpec or a ClusterSpec")
    return serving_cluster(gpu, gpus), None


def engine_for(
    model: ModelSpec,
    gpu: GPUSpec | ClusterSpec,
    plan: ServingPlan,
    params: ModelParams | None = None,
    calibration: Calibration | None = None,
    act_dtype: str = "bf16",
) -> tuple[Engine, ClusterSpec]:
    """The engine and the cluster that price ``plan`` (checked against the model)."""
    plan.check(model)
    if act_dtype not in ("bf16", "fp16", "fp32"):
        raise SpecError("inference.act_dtype", act_dtype, "one of bf16, fp16, fp32")
    cluster, cal = _cluster(gpu, plan.gpus)
    engine = Engine(
        model, cluster.gpu, plan, params or DEFAULT_PARAMS, calibration or cal, act_dtype
    )
    return engine, cluster


def weight_read_s(e: Engine, memory: InferenceMemory) -> float:
    """One decode step's weight reads at the weight-stream rate (the HBM bandwidth on a GPU):
    every stage reads its weights once per micro-batch, pp of them per step."""
    return memory.weights * (1 << 30) / e.weight_Bps * e.plan.pp


def _check_counts(**values: Any) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SpecError(f"inference.{name}", value, "a whole number >= 1")


def bottleneck_sentence(
    decode: StepTime, memory: InferenceMemory, tp: int, weight_read_s: float | None = None
) -> str:
    """The decode step's largest term, in one sentence. ``weight_read_s``: one read of every
    weight of a step at HBM bandwidth; GEMMs well above it are compute-bound."""
    if not memory.fits:
        return (
            f"memory: the batch's KV cache ({memory.kv_cache:.1f} GiB per GPU) does not fit the "
            f"{max(memory.kv_capacity, 0):.1f} GiB left after weights; at most "
            f"{memory.max_batch} sequences fit"
        )
    terms = decode.terms()
    reads = terms["gemm"] + terms["moe_experts"] + terms["logits"]
    kinds = {
        "weight reads and GEMMs": reads,
        "KV-cache reads (decode attention)": terms["attention_decode"],
        "tensor-parallel all-reduces": terms["tp_comm"],
        "MoE dispatch and combine": terms["ep_comm"],
        "kernel launches": terms["launches"],
        "the host issuing every kernel (no CUDA graphs)": terms["host_wait"],
        "pipeline hops": terms["pp_comm"],
        "norms and element-wise work": terms["elementwise"],
    }
    name, value = max(kinds.items(), key=lambda kv: kv[1])
    share = value / decode.total if decode.total else 0.0
    if name == "weight reads and GEMMs" and weight_read_s and reads > 1.5 * weight_read_s:
        return (
            f"decode is bound by GEMM compute ({share:.0%} of a step): the batch already "
            "amortises the weight reads; FP8 GEMMs or more GPUs per instance"
        )
    hint = {
        "weight reads and GEMMs": "a larger batch amortises the weights",
        "KV-cache reads (decode attention)": "FP8 KV or shorter contexts read less",
        "tensor-parallel all-reduces": f"tp {tp} is more than the batch needs",
        "MoE dispatch and combine": "fewer EP ranks per token or a larger batch per rank",
        "kernel launches": "the batch is too small to fill the GPU",
        "the host issuing every kernel (no CUDA graphs)": "capture CUDA graphs (enforce_eager off)",
        "pipeline hops": "fewer pipeline stages",
        "norms and element-wise work": "fused kernels",
    }[name]
    return f"decode is bound by {name} ({share:.0%} of a step): {hint}"


def estimate_inference(
    model: ModelSpec,
    gpu: GPUSpec | ClusterSpec,
    *,
    batch: int,
    prompt_len: int,
    output_len: int,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    ep: int = 1,
    kv_dtype: str = "bf16",
    weight_dtype: str = "bf16",
    act_dtype: str = "bf16",
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
    max_batched_tokens: int = 8192,
    params: ModelParams | None = None,
    calibration: Calibration | None = None,
    software: Software | None = None,
    moe_imbalance: float = 1.0,
) -> InferenceEstimate:
    """Price ``batch`` sequences (over the whole instance, split evenly over ``dp``) of
    ``prompt_len`` prompt tokens, each generating ``output_len`` tokens, as one static batch:
    one prefill of all prompts, then decode steps at the mean context prompt + output / 2.
    ``max_batched_tokens``: the most tokens one step takes (vLLM's max_num_batched_tokens):
    it sizes the activation workspace (prompts are prefilled in chunks of it). ``software``: the
    engine's facts (software.software_for; a current engine by default); ``moe_imbalance``: the
    busiest GPU's routed-expert load over the mean."""
    _check_counts(
        batch=batch,
        prompt_len=prompt_len,
        output_len=output_len,
        max_batched_tokens=max_batched_tokens,
    )
    if not 0 < gpu_memory_utilization <= 1:
        raise SpecError(
            "inference.gpu_memory_utilization", gpu_memory_utilization, "a fraction in (0, 1]"
        )
    plan = ServingPlan(
        tp, pp, dp, ep, kv_dtype, weight_dtype, block_size, software or DEFAULT_SOFTWARE
    )
    plan = dataclasses.replace(plan, moe_imbalance=moe_imbalance)
    e, cluster = engine_for(model, gpu, plan, params, calibration, act_dtype)
    per_dp = batch / dp
    prefill_work = Work(
        prefill_tokens=per_dp * prompt_len, prefill_keys=prompt_len / 2, prefill_len=prompt_len
    )
    ctx = prompt_len + output_len / 2
    prefill = step_time(e, cluster, prefill_work)
    decode = step_time(e, cluster, Work(decode_seqs=per_dp, decode_ctx=ctx))
    memory = inference_memory(
        model,
        cluster.gpu.hbm_gib,
        plan,
        e.params,
        batch=batch,
        seq_len=prompt_len + output_len,
        step_tokens=min(per_dp * prompt_len, max(max_batched_tokens, per_dp)),
        gpu_memory_utilization=gpu_memory_utilization,
        act_bytes=e.act_bytes,
    )
    total = prefill.total + max(output_len - 1, 0) * decode.total
    per_gpu = batch * output_len / total / plan.gpus if total > 0 else math.inf
    return InferenceEstimate(
        plan=plan,
        batch=batch,
        prompt_len=prompt_len,
        output_len=output_len,
        prefill_s=prefill.total,
        decode_step_s=decode.total,
        ttft_s=prefill.total,
        tpot_s=decode.total,
        tokens_per_s_per_gpu=per_gpu,
        tokens_per_s_per_request=1.0 / decode.total if decode.total > 0 else math.inf,
        memory=memory,
        bottleneck=bottleneck_sentence(decode, memory, tp, weight_read_s(e, memory)),
        prefill=prefill,
        decode=decode,
    )
