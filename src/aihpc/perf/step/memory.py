"""Per-GPU memory of the most loaded rank: weights, gradients, optimizer, activations, buffers.

Sources: mixed-precision Adam bytes per parameter and ZeRO stages (Rajbhandari et al. 2020, §3;
Megatron-LM ``theoretical_memory_usage.py``: 18 B/param, 6 + 12/d with the distributed
optimizer); activation bytes per layer from the tensors each op saves for backward (Korthikanti
et al. 2022, §4.1 and Table 2: sbh(34 + 5as/h) without parallelism, /t with SP, 34sbh/t with
selective recompute, 2sbh with full recompute); in-flight micro-batches of 1F1B and the
interleaving penalty 1 + (p-1)/(pv) (Korthikanti §4.2.3; Narayanan et al. 2021 §2.2); FSDP2's
gradients counted only from each model chunk's first backward to the next step's zero_grad
(``lazy_grad_points``); layers offloaded to host memory (Megatron-Core
``cpu_offloading_num_layers``) leave GPU memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from aihpc.perf.step import plan_batch
from aihpc.perf.step.flops import (
    layer_gemms,
    op_sac_saved,
)
from aihpc.perf.step.numeric import minimum, where
from aihpc.runspec.model import ModelSpec
from aihpc.runspec.parallel import ParallelPlan
from aihpc.runspec.training import DTYPE_BYTES, TrainingSpec

__all__ = [
    "GiB",
    "MemoryBreakdown",
    "activation_bytes_per_layer",
    "checkpoint_bytes",
    "fsdp_lazy_grads",
    "lazy_grad_points",
    "offload_split",
    "zero3_keeps_unsharded",
]

GiB = float(1 << 30)
MOMENTS = {"adamw": 2, "adam": 2, "sgd": 1}  # optimizer state tensors per parameter


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one GPU. ``logits`` holds the embedding/output/loss buffers; ``other`` the runtime
    (CUDA context, workspaces, NCCL) and allocator fragmentation."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    other: float
    stage: str  # which pipeline stage is the most loaded: "first", "last" or "only"
    offloaded: float = (
        0.0  # activations held in host memory (parallel.offload_layers), not in total
    )
    # FSDP2 gradients the step creates after the memory peak (in its backward), not in total
    gradients_after_peak: float = 0.0

    @property
    def total(self) -> float:
        return (
            self.weights
            + self.gradients
            + self.optimizer
            + self.activations
            + self.logits
            + self.other
        )

    def gib(self) -> dict[str, float]:
        parts = ("weights", "gradients", "optimizer", "activations", "logits", "other")
        out = {"total": self.total / GiB}
        out.update({p: getattr(self, p) / GiB for p in parts})
        return out


def activation_bytes_per_layer(
    model: ModelSpec, plan: ParallelPlan, training: TrainingSpec, recompute: str | None = None
) -> float:
    """Bytes one layer keeps for its backward, for one micro-batch, on one GPU; for an MoE
    model, the mean over its dense and MoE layers.

    Counted tensor by tensor (16-bit activations, 1-byte dropout masks): LayerNorm inputs,
    GEMM inputs, Q/K/V, the attention scores path when unfused, activation-function inputs.
    """
    if not model.is_moe:
        return _activation_bytes(model, plan, training, recompute, False)
    frac = model.num_moe_layers / model.num_layers
    moe = _activation_bytes(model, plan, training, recompute, True)
    if frac >= 1:
        return moe
    return frac * moe + (1 - frac) * _activation_bytes(model, plan, training, recompute, False)


def _activation_bytes(
    model: ModelSpec,
    plan: ParallelPlan,
    training: TrainingSpec,
    recompute: str | None,
    moe: bool,
) -> float:
    recompute = recompute or plan.recompute
    tokens = plan.micro_batch_size * model.seq_length / plan.cp
    sp = plan.tp if plan.sequence_parallel else 1
    if recompute == "full":
        return 2 * model.hidden_size * tokens / sp  # only the layer input is kept
    if recompute == "op":
        return tokens * _op_sac_kept(model, plan, moe, sp)
    replicated, split = _kept_per_token(model, plan, training, recompute, moe, sp)
    return tokens * (replicated + split / plan.tp)


def _op_sac_kept(model: ModelSpec, plan: ParallelPlan, moe: bool, sp: int) -> float:
    """Bytes per token kept by op-level selective checkpointing: the layer input, the
    attention output and log-sum-exp, and every other matmul output (column-parallel ones split
    over TP)."""
    t = plan.tp
    hq = model.num_attention_heads * model.kv_channels
    kept = 2 * model.hidden_size / sp + (2 * hq + 4 * model.num_attention_heads) / t
    for i, (_, _, n_out, row) in enumerate(layer_gemms(model, moe)):
        if op_sac_saved(i):
            kept += 2 * (n_out if row else n_out / t)
    return kept


def _kept_per_token(
    model: ModelSpec,
    plan: ParallelPlan,
    training: TrainingSpec,
    recompute: str,
    moe: bool,
    sp: int,
) -> tuple[float, float]:
    """(bytes per token replicated across TP unless sequence parallel, bytes per token split
    over TP) that a layer keeps for its backward without full or op-level recompute."""
    h, drop = model.hidden_size, training.dropout > 0
    # Replicated across TP unless sequence parallel: 2 norm inputs, 2 GEMM inputs, 2 masks.
    replicated = (8 * h + (2 * h if drop else 0)) / sp
    act_in, fc2_in = _ffn_kept(model, plan, training, moe)
    split, hq, hkv = _attention_kept(model, plan, act_in, fc2_in)
    if training.kv_repeat:  # the attention kernel saves the K and V repeated to every head
        split += 4 * (hq - hkv)
    fp8_in = training.precision == "fp8" and training.fp8_saved_inputs in ("fp8", "deepseek")
    if fp8_in:
        # Transformer Engine keeps an FP8 linear's input in FP8 for the weight gradient: the
        # QKV and FFN-in GEMM inputs and the FFN-out input take 1 byte, not 2; the projection's
        # FP8 input is kept beside the attention output the attention backward needs in 16 bits.
        # DeepSeek-V3 keeps that output once, in E5M6 (1.5 bytes), for both (sec. 3.3.3).
        replicated -= 2 * h / sp
        e5m6 = training.fp8_saved_inputs == "deepseek"
        split += -fc2_in / 2 + (-0.5 * hq if e5m6 else hq)
    if "layernorm" in plan.recompute_modules:  # the norms' outputs (the GEMM inputs) remade
        replicated -= (2 if fp8_in else 4) * h / sp
    if training.attention == "unfused" and recompute == "none":
        s_kv = model.seq_length  # scores over the whole sequence
        split += model.num_attention_heads * s_kv * (5 if drop else 2)  # softmax out (+ mask)
    elif training.attention != "unfused":  # every fused kernel class
        split += 4 * model.num_attention_heads  # fp32 log-sum-exp per head
    return replicated, split


def _ffn_kept(
    model: ModelSpec, plan: ParallelPlan, training: TrainingSpec, moe: bool
) -> tuple[float, float]:
    """(FFN input bytes, FFN-out input bytes) per token, before the TP split; for an MoE layer
    everything in the first (its second is then 0)."""
    h = model.hidden_size
    ffn = model.expert_ffn_hidden_size if moe else model.ffn_hidden_size
    act_in = 4 * ffn if model.ffn_activation == "swiglu" else 2 * ffn  # gate+up, or one input
    fc2_in = act_in // 2 if model.ffn_activation == "swiglu" else act_in
    if "mlp" in plan.recompute_modules and not moe:  # the dense FFN keeps only its input
        return 0, 0
    if not moe:
        return act_in, fc2_in
    # Shared experts run on this rank's tokens split over TP like a dense FFN. Routed ones: a
    # token's top_k copies (times the routing imbalance on the busiest rank) land on the
    # etp x ep expert ranks; per attention-layout token that is top_k x etp copies over t
    # ranks, each keeping its permuted input (h), its FFN input and activation input split
    # over etp; plus the router's fp32 scores. With FP8 linears keeping FP8 inputs, the
    # permuted input and the FFN-out input take 1 byte per value.
    fp8 = training.precision == "fp8" and training.fp8_saved_inputs in ("fp8", "deepseek")
    inp, out_in = (h, fc2_in / 2) if fp8 else (2 * h, fc2_in)
    if training.precision == "fp8" and training.fp8_saved_inputs == "deepseek":
        act_in /= 2  # the experts' SwiGLU inputs cached in FP8 (DeepSeek-V3 sec. 3.3.3)
    if "moe_act" in plan.recompute_modules:  # the activation's output is made again
        out_in = 0
    copies = model.moe_top_k * training.moe_imbalance
    shared = model.num_shared_experts * (act_in + out_in)
    routed = copies * (inp * plan.etp + act_in + out_in)
    return shared + routed + 4 * model.num_experts, 0


def _attention_kept(
    model: ModelSpec, plan: ParallelPlan, act_in: float, fc2_in: float
) -> tuple[float, int, int]:
    """(bytes per token split over TP: attention and FFN inputs, query width, key-value
    width)."""
    d = model.kv_channels
    hq, hkv = model.num_attention_heads * d, model.kv_heads * d
    if not model.is_mla:  # Q, K, V, projection input, FFN
        return 2 * (hq + hkv) + 2 * hkv + 2 * hq + act_in + fc2_in, hq, hkv
    # MLA: per-head Q and K of qk width, V and the projection input of v width; the query and
    # key-value latents feeding the up projections are whole on every TP rank.
    assert model.kv_lora_rank is not None and model.qk_rope_head_dim is not None
    dqk = (model.qk_nope_head_dim or 0) + model.qk_rope_head_dim
    dv, a = model.v_head_dim or 0, model.num_attention_heads
    latents = 2 * ((model.q_lora_rank or 0) + model.kv_lora_rank + model.qk_rope_head_dim)
    qkv = 0 if "mla_up_proj" in plan.recompute_modules else 2 * a * (2 * dqk + dv)
    return qkv + 2 * a * dv + latents * plan.tp + act_in + fc2_in, a * dv, hkv


def offload_split(layers: int, offload: int) -> tuple[int, int]:
    """(layers whose activations are on the GPU at the forward's peak, layers offloaded).

    Megatron-Core offloads the first ``offload`` layers' saved tensors on a side stream as each
    layer finishes and reloads them one layer ahead of the backward (cpu_offload.py, double
    buffered), so at the end of the forward the other layers are on the GPU; while the last
    offloaded layer copies out, the next one fills: never fewer than two layers live.
    """
    if not offload:
        return layers, 0
    return max(layers - offload, min(layers, 2)), offload


def _layer_params_local(model: ModelSpec, plan: ParallelPlan, layers: int) -> float:
    """Parameters of ``layers`` layers on one GPU (both parts of ``layer_params_split``)."""
    dense, experts = layer_params_split(model, plan, layers)
    return dense + experts if experts else dense


def layer_params_split(model: ModelSpec, plan: ParallelPlan, layers: int) -> tuple[float, float]:
    """(parameters split over TP, routed-expert parameters) of ``layers`` layers on one GPU
    (plan_batch.layer_params_split, which the step-time terms call over arrays)."""
    return plan_batch.layer_params_split(model, layers, plan.tp, plan.etp, plan.ep)


def largest_param_tensor(model: ModelSpec) -> int:
    """Elements of the layer's largest weight in Megatron's layout (fused QKV; fused gate+up)."""
    gemms = {name: n_in * n_out for name, n_in, n_out, _ in layer_gemms(model, model.is_moe)}
    qkv = gemms.pop("wq") + gemms.pop("wk") + gemms.pop("wv")
    if "w1" in gemms:
        gemms["w1"] += gemms.pop("w3")
    return max(qkv, *gemms.values())


def fsdp_lazy_grads(plan: ParallelPlan, training: TrainingSpec) -> bool:
    """ZeRO-3 as FSDP2 runs it: gradients exist only from a chunk's first backward to the next
    step's zero_grad. DeepSpeed 0.3's ZeRO-3 (``zero3_gather = "per_tensor"``) keeps a
    preallocated flat gradient partition, as Megatron's optimizers keep their buffers."""
    return plan.zero_stage == 3 and training.zero3_gather == "bucketed"


def zero3_keeps_unsharded(plan: ParallelPlan) -> bool:
    """ZeRO-3 under pipeline parallelism gathers each stage once per step and keeps it."""
    return plan.zero_stage == 3 and plan.pp > 1


def warmup_chunks(p: Any, v: Any, m: Any, rank: Any = 0) -> Any:
    """Forwards pipeline rank ``rank`` runs before its first backward (Megatron-LM's
    ``num_warmup_microbatches``; PyTorch's ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` run the
    same order): p - 1 - rank under 1F1B, 2(p - 1 - rank) + (v - 1)p interleaved, at most the
    step's m v model chunks."""
    ahead = where(v == 1, p - 1 - rank, 2 * (p - 1 - rank) + (v - 1) * p)
    return minimum(ahead, m * v)


@lru_cache(maxsize=4096)
def lazy_grad_points(p: int, v: int, m: int, rank: int = 0) -> tuple[tuple[int, int, int], ...]:
    """Where a pipeline rank's memory can peak when its gradients appear only at their chunk's
    first backward: (model chunks of activations held, chunks whose gradients exist, 1 if a
    micro-batch of the last model chunk is between its forward and its backward, else 0)
    triples, the ones no other triple beats in all three (a chunk is L/v of the stage's layers
    for one micro-batch). The third says whether the loss's logits buffers are live, on the
    rank that holds the output layer.

    The schedule: ``warmup_chunks`` forwards, then forward / backward pairs, then the remaining
    backwards; the k-th forward runs chunk (k // p) mod v, the k-th backward chunk
    v - 1 - (k // p) mod v. Once every chunk has had a backward and a forward leaves the rank
    holding a last-chunk micro-batch, it holds its most activations, all its gradients and
    the logits at once, and nothing later is higher, so the walk stops there.
    """
    total = m * v
    warm = warmup_chunks(p, v, m, rank)

    def ops() -> Iterator[tuple[bool, int]]:  # generated: a step may have millions of chunks
        yield from ((True, k) for k in range(warm))
        for i in range(total - warm):
            yield True, warm + i
            yield False, i
        yield from ((False, k) for k in range(total - warm, total))

    held, tail, seen, points = 0, 0, set(), []
    for forward, k in ops():
        chunk = (k // p) % v if forward else v - 1 - (k // p) % v
        if forward:
            held += 1
            tail += chunk == v - 1
            points.append((held, len(seen), min(tail, 1)))
            if len(seen) == v and tail:
                break
        else:  # the backward's recompute runs before it frees
            points.append((held, len(seen), min(tail, 1)))
            seen.add(chunk)
            held -= 1
            tail -= chunk == v - 1
            points.append((held, len(seen), min(tail, 1)))
    uniq = set(points)
    beaten = _dominated(uniq)
    return tuple(a for a in uniq if a not in beaten)


def _dominated(points: set[tuple[int, int, int]]) -> set[tuple[int, int, int]]:
    """The points some other point beats in all three (>=), by one sweep in falling order:
    every point seen before ``a`` holds at least a's activations, so one beats ``a`` iff it also
    has at least a's gradients and its logits flag (0 or 1) is at least a's."""
    best_any = best_live = -1  # most gradients among points seen: any flag, flag 1
    beaten = set()
    for a in sorted(points, reverse=True):
        _, grads, live = a
        if (best_live if live else best_any) >= grads:
            beaten.add(a)
        best_any = max(best_any, grads)
        if live:
            best_live = max(best_live, grads)
    return beaten


def checkpoint_bytes(model: ModelSpec, training: TrainingSpec) -> float:
    """Bytes of one full training checkpoint of the whole job: 16-bit weights, master weights and
    the optimizer moments (Adam: m and v) in ``optimizer_dtype``, i.e. 14 B/param for Adam in
    fp32 mixed precision (Megatron-LM and DCP checkpoints store exactly these), 8 B in bf16."""
    from aihpc.perf.step.flops import num_params

    o = DTYPE_BYTES[training.optimizer_dtype]
    moments = MOMENTS[training.optimizer]
    return num_params(model) * (2 + o * (1 + moments))
