"""Serving under load: continuous batching in steady state over prompt and output lengths,
with or without chunked prefill, and disaggregated prefill and decode pools.

Steady state (vLLM's, SGLang's and TensorRT-LLM's in-flight batching under a full queue): the
engine keeps ``B`` sequences in flight, B the smaller of its sequence cap and what the KV cache
holds. Each step every running sequence adds one token, and the sequences that finish are
replaced: on average B / output_len new prompts enter per step, so a step also prefills
B x prompt_len / output_len prompt tokens. With chunked prefill (the default of vLLM V1 and
TensorRT-LLM) those tokens ride in the same step as the decodes (one pass over the weights);
without it they run as prefill steps of their own between decode steps. Throughput is B output
tokens per step; TPOT the time between a sequence's steps; TTFT the prompt's chunks, one per
step.

Lengths may be a single value or a distribution (``LengthDist``): the mean sets the steady
state's work; a distribution's spread sets the KV pages a sequence holds (its mean length) and,
for a phase that must finish every sequence (an RL rollout, rollout.py), the longest one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from aihpc.perf.infer.comm import kv_transfer_s
from aihpc.perf.infer.estimate import engine_for
from aihpc.perf.infer.kernels import Engine, Work
from aihpc.perf.infer.kv import ServingPlan, kv_bytes_per_token
from aihpc.perf.infer.memory import InferenceMemory, inference_memory
from aihpc.perf.infer.step import StepTime, step_time
from aihpc.perf.step.params import ModelParams
from aihpc.runspec.calibration import Calibration
from aihpc.runspec.cluster import ClusterSpec, GPUSpec
from aihpc.runspec.errors import SpecError
from aihpc.runspec.model import ModelSpec

__all__ = [
    "Load",
    "ServingEstimate",
    "decode_throughput",
    "disaggregated",
    "prefill_throughput",
    "steady_state",
]


@dataclass(frozen=True)
class Load:
    """What the engine serves: mean prompt and output lengths, the most sequences it runs at
    once (None: as many as the KV cache holds), the tokens one step takes, chunked prefill,
    and the share of prompt tokens found in a prefix cache (not computed, but attended to)."""

    prompt_len: float
    output_len: float
    max_seqs: int | None = None
    max_batched_tokens: int = 8192
    chunked_prefill: bool = True
    prefix_hit: float = 0.0
    gpu_memory_utilization: float = 0.9
    # TensorRT-LLM's kv_cache_free_gpu_mem_fraction: the KV cache's share of the memory left
    # free (in place of gpu_memory_utilization's share of the whole GPU); None: not used.
    kv_free_fraction: float | None = None
    # The scheduler reserves a sequence's whole length (prompt + output) when it admits it
    # (TensorRT-LLM's default capacity policy GUARANTEED_NO_EVICT), instead of taking pages as
    # the sequence grows (vLLM, SGLang: its mean length, prompt + output / 2).
    reserve_full: bool = False

    @property
    def held_len(self) -> float:
        """KV tokens a sequence in flight holds, on average."""
        return self.prompt_len + (self.output_len if self.reserve_full else self.output_len / 2)

    def check(self) -> None:
        for name in ("prompt_len", "output_len"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 1:
                raise SpecError(f"inference.{name}", value, "a length >= 1 token")
        if self.max_seqs is not None and (not isinstance(self.max_seqs, int) or self.max_seqs < 1):
            raise SpecError("inference.max_seqs", self.max_seqs, "a whole number >= 1")
        if not isinstance(self.max_batched_tokens, int) or self.max_batched_tokens < 1:
            raise SpecError(
                "inference.max_batched_tokens", self.max_batched_tokens, "a whole number >= 1"
            )
        if not 0 <= self.prefix_hit < 1:
            raise SpecError("inference.prefix_hit", self.prefix_hit, "a fraction in [0, 1)")
        frac = self.kv_free_fraction
        if frac is not None and not 0 < frac <= 1:
            raise SpecError("inference.kv_free_fraction", frac, "a fraction in (0, 1]")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise SpecError(
                "inference.gpu_memory_utilization",
                self.gpu_memory_utilization,
                "a fraction in (0, 1]",
            )


@dataclass(frozen=True)
class ServingEstimate:
    """Steady-state serving of one instance of ``plan``."""

    plan: ServingPlan
    load: Load
    batch: int  # sequences in flight over the instance
    step: StepTime
    ttft_s: float
    tpot_s: float
    memory: InferenceMemory
    limit: str  # what set the batch: "max_seqs" or "kv_cache"

    @property
    def output_tokens_per_s(self) -> float:
        return self.batch / self.tpot_s if self.tpot_s > 0 else math.inf

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.output_tokens_per_s / self.plan.gpus

    @property
    def input_tokens_per_s(self) -> float:
        return self.output_tokens_per_s * self.load.prompt_len / self.load.output_len

    def to_json(self) -> dict[str, Any]:
        return {
            "plan": self.plan.to_json(),
            "prompt_len": self.load.prompt_len,
            "output_len": self.load.output_len,
            "batch": self.batch,
            "batch_limited_by": self.limit,
            "chunked_prefill": self.load.chunked_prefill,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "input_tokens_per_s": self.input_tokens_per_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "tokens_per_s_per_request": 1.0 / self.tpot_s if self.tpot_s > 0 else math.inf,
            "memory": self.memory.to_json(),
            "step_terms": self.step.to_json(),
        }


def _batch(load: Load, memory: InferenceMemory) -> tuple[int, str]:
    if load.max_seqs is not None and load.max_seqs <= memory.max_batch:
        return load.max_seqs, "max_seqs"
    return max(memory.max_batch, 0), "kv_cache"


def _memory(
    model: ModelSpec, cluster: ClusterSpec, plan: ServingPlan, e: Engine, load: Load, batch: int
) -> InferenceMemory:
    return inference_memory(
        model,
        cluster.gpu.hbm_gib,
        plan,
        e.params,
        batch=batch,
        seq_len=load.held_len,
        step_tokens=load.max_batched_tokens,
        gpu_memory_utilization=load.gpu_memory_utilization,
        act_bytes=e.act_bytes,
        kv_free_fraction=load.kv_free_fraction,
    )


def steady_state(
    model: ModelSpec,
    gpu: GPUSpec | ClusterSpec,
    plan: ServingPlan,
    load: Load,
    params: ModelParams | None = None,
    calibration: Calibration | None = None,
    batch: int | None = None,
) -> ServingEstimate:
    """Steady-state continuous batching of ``load`` on one instance of ``plan`` (``batch``:
    the sequences in flight, instead of the most the engine holds)."""
    load.check()
    e, cluster = engine_for(model, gpu, plan, params, calibration)
    isl, osl = load.prompt_len, load.output_len
    mean_len = isl + osl / 2  # the mean context a decoding sequence attends to
    memory = _memory(model, cluster, plan, e, load, batch or 1)
    if batch is None:
        batch, limit = _batch(load, memory)
    else:
        limit = "given"
    if batch < 1:
        raise SpecError(
            "inference.gpu_memory_utilization",
            load.gpu_memory_utilization,
            f"leaves no KV cache: the weights take {memory.weights:.1f} GiB of "
            f"{memory.usable:.1f} GiB per GPU; use more GPUs (tp, pp, ep) or lower precision",
        )
    memory = _memory(model, cluster, plan, e, load, batch)
    if limit == "kv_cache" and memory.max_batch < batch:  # the batch's own logits took room
        batch = memory.max_batch
        memory = _memory(model, cluster, plan, e, load, batch)
    b = batch / plan.dp
    new = b * isl / osl * (1 - load.prefix_hit)  # computed prompt tokens per step
    keys = isl * load.prefix_hit + isl * (1 - load.prefix_hit) / 2
    decode = Work(decode_seqs=b, decode_ctx=mean_len)
    if load.chunked_prefill:
        step = step_time(e, cluster, Work(new, keys, isl, b, mean_len))
        per_chunk = max(1.0, load.max_batched_tokens - b)
        ttft = math.ceil(isl * (1 - load.prefix_hit) / per_chunk) * step.total
        return ServingEstimate(plan, load, batch, step, ttft, step.total, memory, limit)
    dec = step_time(e, cluster, decode)
    pre = step_time(e, cluster, Work(prefill_tokens=new, prefill_keys=keys, prefill_len=isl))
    merged = StepTime(
        compute=dec.compute,
        tp_comm=dec.tp_comm,
        ep_comm=dec.ep_comm,
        pp_comm=dec.pp_comm + pre.total,  # prefill steps between decode steps
        stages=dec.stages,
        host_issue=dec.host_issue,
    )
    one = step_time(e, cluster, Work(prefill_tokens=isl, prefill_keys=keys, prefill_len=isl))
    return ServingEstimate(plan, load, batch, merged, one.total, merged.total, memory, limit)


@dataclass(frozen=True)
class DisaggregatedEstimate:
    """Prefill and decode in separate pools (Mooncake, DistServe, DeepSeek's service): the
    prompt's KV cache crosses the fabric once. Throughputs are per pool; the pools' sizes
    that balance them follow (decode GPUs per prefill GPU)."""

    prefill_tokens_per_s_per_gpu: float
    decode: ServingEstimate
    kv_transfer_s: float
    ttft_s: float
    decode_gpus_per_prefill_gpu: float

    def to_json(self) -> dict[str, Any]:
        return {
            "prefill_tokens_per_s_per_gpu": self.prefill_tokens_per_s_per_gpu,
            "kv_transfer_s": self.kv_transfer_s,
            "ttft_s": self.ttft_s,
            "decode_gpus_per_prefill_gpu": self.decode_gpus_per_prefill_gpu,
            "decode": self.decode.to_json(),
        }


def prefill_throughput(
    model: ModelSpec,
    gpu: GPUSpec | ClusterSpec,
    plan: ServingPlan,
    load: Load,
    params: ModelParams | None = None,
    calibration: Calibration | None = None,
) -> tuple[float, StepTime]:
    """Prompt tokens per second per GPU of a prefill pool whose steps take
    ``max_batched_tokens`` tokens per data-parallel rank (whole prompts, at least one), and
    one step's time. Counted tokens include the prefix-cache hits (DeepSeek's convention)."""
    load.check()
    e, cluster = engine_for(model, gpu, plan, params, calibration)
    isl, hit = load.prompt_len, load.prefix_hit
    prompts = max(1.0, load.max_batched_tokens / (isl * (1 - hit)))
    work = Work(
        prefill_tokens=prompts * isl * (1 - hit),
        prefill_keys=isl * hit + isl * (1 - hit) / 2,
        prefill_len=isl,
    )
    mem = inference_memory(
        model,
        cluster.gpu.hbm_gib,
        plan,
        e.params,
        batch=math.ceil(prompts) * plan.dp,
        seq_len=isl,
        step_tokens=load.max_batched_tokens,
        gpu_memory_utilization=load.gpu_memory_utilization,
        act_bytes=e.act_bytes,
        kv_free_fraction=load.kv_free_fraction,
    )
    if not mem.fits:
        raise SpecError(
            "inference.prefill_ep" if model.is_moe else "inference.prefill_tp",
            plan.ep if model.is_moe else plan.tp,
            f"the prefill pool's weights ({mem.weights:.1f} GiB per GPU) and one step's prompts "
            f"do not fit {mem.usable:.1f} GiB per GPU: spread them over more GPUs",
        )
    step = step_time(e, cluster, work)
    return prompts * isl * plan.dp / step.total / plan.gpus, step


def decode_throughput(
    model: ModelSpec,
    gpu: GPUSpec | ClusterSpec,
    plan: ServingPlan,
    batch: int,
    context: float,
    params: ModelParams | None = None,
) -> tuple[float, StepTime]:
    """Output tokens per second per GPU of a decode pool running ``batch`` sequences (over the
    instance) at a mean context of ``context`` tokens, and its step."""
    e, cluster = engine_for(model, gpu, plan, params)
    step = step_time(e, cluster, Work(decode_seqs=batch / plan.dp, decode_ctx=context))
    return batch / step.total / plan.gpus, step


def disaggregated(
    model: ModelSpec,
    gpu: GPUSpec | ClusterSpec,
    prefill_plan: ServingPlan,
    decode_plan: ServingPlan,
    load: Load,
    params: ModelParams | None = None,
    decode_batch: int | None = None,
) -> DisaggregatedEstimate:
    """A prefill pool on ``prefill_plan`` feeding a decode pool on ``decode_plan``: the decode
    pool runs only decode steps (its prompts arrive with their KV cache), the prefill pool
    only prompts; the KV cache of one prompt moves over the scale-out network, every GPU of
    the prefill instance sending its shard."""
    per_gpu, pre_step = prefill_throughput(model, gpu, prefill_plan, load, params)
    decode_load = Load(
        prompt_len=load.prompt_len,
        output_len=load.output_len,
        max_seqs=load.max_seqs,
        max_batched_tokens=load.max_batched_tokens,
        chunked_prefill=True,
        prefix_hit=0.0,
        gpu_memory_utilization=load.gpu_memory_utilization,
        kv_free_fraction=load.kv_free_fraction,
        reserve_full=load.reserve_full,
    )
    e, cluster = engine_for(model, gpu, decode_plan, params)
    decode = steady_state(model, gpu, decode_plan, decode_load, params, batch=decode_batch)
    context = load.prompt_len + load.output_len / 2
    _, step = decode_throughput(model, gpu, decode_plan, decode.batch, context, params)
    decode = ServingEstimate(
        decode.plan, decode.load, decode.batch, step, 0.0, step.total, decode.memory, decode.limit
    )
    kv = kv_bytes_per_token(model, prefill_plan) * load.prompt_len
    transfer = kv_transfer_s(kv, cluster, e.params)
    ttft = pre_step.total + transfer
    input_per_gpu = decode.tokens_per_s_per_gpu * load.prompt_len / load.output_len
    ratio = per_gpu / input_per_gpu if input_per_gpu > 0 else math.inf
    return DisaggregatedEstimate(per_gpu, decode, transfer, ttft, ratio)
