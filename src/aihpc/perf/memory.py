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

from aihpc.perf import plan_batch
from aihpc.perf.flops import (
    embedding_params,
    layer_gemms,
    op_sac_saved,
)
from aihpc.perf.numeric import minimum, where
from aihpc.perf.params import DEFAULT_PARAMS, ModelParams
from aihpc.spec.cluster import ClusterSpec
from aihpc.spec.model import ModelSpec
from aihpc.spec.parallel import ParallelPlan
from aihpc.spec.training import DTYPE_BYTES, TrainingSpec

__all__ = [
    "GiB",
    "MemoryBreakdown",
    "activation_bytes_per_layer",
    "checkpoint_bytes",
    "fsdp_lazy_grads",
    "lazy_grad_points",
    "memory_breakdown",
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
    h, d = model.hidden_size, model.kv_channels
    hq, hkv = model.num_attention_heads * d, model.kv_heads * d
    t = plan.tp
    tokens = plan.micro_batch_size * model.seq_length / plan.cp
    sp = t if plan.sequence_parallel else 1
    if recompute == "full":
        return 2 * h * tokens / sp  # only the layer input is kept
    if recompute == "op":
        # Op-level selective checkpointing keeps the layer input, the attention output and
        # log-sum-exp, and every other matmul output (column-parallel ones split over TP).
        kept = 2 * h / sp + (2 * hq + 4 * model.num_attention_heads) / t
        for i, (_, _, n_out, row) in enumerate(layer_gemms(model, moe)):
            if op_sac_saved(i):
                kept += 2 * (n_out if row else n_out / t)
        return tokens * kept
    drop = training.dropout > 0
    # Replicated across TP unless sequence parallel: 2 norm inputs, 2 GEMM inputs, 2 masks.
    replicated = (8 * h + (2 * h if drop else 0)) / sp
    ffn = model.expert_ffn_hidden_size if moe else model.ffn_hidden_size
    act_in = 4 * ffn if model.ffn_activation == "swiglu" else 2 * ffn  # gate+up, or one input
    fc2_in = act_in // 2 if model.ffn_activation == "swiglu" else act_in
    if "mlp" in plan.recompute_modules and not moe:  # the dense FFN keeps only its input
        act_in, fc2_in = 0, 0
    if moe:
        # Shared experts run on this rank's tokens split over TP like a dense FFN. Routed ones:
        # a token's top_k copies (times the routing imbalance on the busiest rank) land on the
        # etp x ep expert ranks; per attention-layout token that is top_k x etp copies over t
        # ranks, each keeping its permuted input (h), its FFN input and activation input split
        # over etp; plus the router's fp32 scores.
        # With FP8 linears keeping FP8 inputs (below), the permuted input and the FFN-out input
        # take 1 byte per value.
        fp8 = training.precision == "fp8" and training.fp8_saved_inputs == "fp8"
        inp, out_in = (h, fc2_in / 2) if fp8 else (2 * h, fc2_in)
        if "moe_act" in plan.recompute_modules:  # the activation's output is made again
            out_in = 0
        copies = model.moe_top_k * training.moe_imbalance
        shared = model.num_shared_experts * (act_in + out_in)
        routed = copies * (inp * plan.etp + act_in + out_in)
        act_in, fc2_in = shared + routed, 0
        act_in += 4 * model.num_experts
    if model.is_mla:
        # MLA: per-head Q and K of qk width, V and the projection input of v width; the query
        # and key-value latents feeding the up projections are whole on every TP rank.
        assert model.kv_lora_rank is not None and model.qk_rope_head_dim is not None
        dqk, dv = model.qk_nope_head_dim or 0, model.v_head_dim or 0
        dqk += model.qk_rope_head_dim
        a = model.num_attention_heads
        latents = 2 * ((model.q_lora_rank or 0) + model.kv_lora_rank + model.qk_rope_head_dim)
        qkv = 0 if "mla_up_proj" in plan.recompute_modules else 2 * a * (2 * dqk + dv)
        split = qkv + 2 * a * dv + latents * t + act_in + fc2_in
        hq = a * dv
    else:
        split = 2 * (hq + hkv) + 2 * hkv + 2 * hq + act_in + fc2_in  # Q, K, V, proj input, FFN
    if training.kv_repeat:  # the attention kernel saves the K and V repeated to every head
        split += 4 * (hq - hkv)
    if training.precision == "fp8" and training.fp8_saved_inputs == "fp8":
        # Transformer Engine keeps an FP8 linear's input in FP8 for the weight gradient: the
        # QKV and FFN-in GEMM inputs and the FFN-out input take 1 byte, not 2; the projection's
        # FP8 input is kept beside the attention output the attention backward needs in 16 bits.
        replicated -= 2 * h / sp
        split += -fc2_in / 2 + hq
    if "layernorm" in plan.recompute_modules:  # the norms' outputs (the GEMM inputs) remade
        fp8_in = training.precision == "fp8" and training.fp8_saved_inputs == "fp8"
        replicated -= (2 if fp8_in else 4) * h / sp
    if training.attention == "unfused" and recompute == "none":
        a = model.num_attention_heads
        s_kv = model.seq_length  # scores over the whole sequence
        split += a * s_kv * (5 if drop else 2)  # softmax out (+ dropout mask and output)
    elif training.attention in ("flash", "flash2"):
        split += 4 * model.num_attention_heads  # fp32 log-sum-exp per head
    return tokens * (replicated + split / t)


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


def _state_bytes(
    params_local: float,
    plan: ParallelPlan,
    training: TrainingSpec,
    layer_params_local: float,
    shard: int | None = None,
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes for ``params_local`` parameters on this rank.

    zero 0-2 follow Megatron-LM: 16-bit weights, fp32 main gradients, fp32 master + Adam m, v
    (18 B/param unsharded). zero 3 follows FSDP2 with mixed precision: the sharded fp32
    parameter is the master copy, gradients are reduced to fp32 shards, plus the 16-bit
    parameters of the layers being gathered (current + prefetched) and one layer's gradients
    (with ``zero3_gather = "per_tensor"``, DeepSpeed 0.3's, the largest tensor instead of a layer).
    Under pipeline parallelism FSDP2 keeps the stage's parameters gathered across the step's
    micro-batches and accumulates unsharded fp32 gradients, reduce-scattering once at the end
    (torchtitan disables resharding after forward with PP): the stage then holds a full 16-bit
    copy of its weights and a full fp32 gradient. ``grad_reduce_dtype`` and ``optimizer_dtype``
    = bf16 halve the gradient and the master/moment bytes.
    """
    d = plan.shard_group * plan.cp  # ranks that share (shard) these states: all dp, or HSDP's group
    if shard is not None:  # routed experts: their expert-data-parallel replicas
        d = shard
    g, o = DTYPE_BYTES[training.grad_reduce_dtype], DTYPE_BYTES[training.optimizer_dtype]
    moments = MOMENTS[training.optimizer]
    fp8_cache = 1.0 if training.precision == "fp8" else 0.0  # FP8 copies of the weights
    z = plan.zero_stage
    if z == 3:
        if zero3_keeps_unsharded(plan):
            weights = o * params_local / d + (2 + fp8_cache) * params_local
            grads = g * params_local / d + g * params_local
        else:
            weights = o * params_local / d + (2 + fp8_cache) * 2 * layer_params_local
            grads = g * params_local / d + g * layer_params_local
        optimizer = moments * o * params_local / d
        return weights, grads, optimizer
    weights = (2 + fp8_cache) * params_local
    grads = g * params_local / (d if z == 2 else 1)
    optimizer = (1 + moments) * o * params_local / (d if z >= 1 else 1)
    return weights, grads, optimizer


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
    return tuple(
        a
        for a in uniq
        if not any(b != a and all(x >= y for x, y in zip(b, a, strict=True)) for b in uniq)
    )


def memory_breakdown(
    model: ModelSpec,
    cluster: ClusterSpec,
    plan: ParallelPlan,
    training: TrainingSpec,
    params: ModelParams = DEFAULT_PARAMS,
) -> MemoryBreakdown:
    """Memory of the most loaded GPU (first or last pipeline stage)."""
    del cluster  # the memory model is independent of the interconnect
    p, v = plan.pp, plan.vpp
    layers_per_stage = plan.layers_per_stage(model.num_layers)
    layer_local = _layer_params_local(model, plan, 1)
    if training.zero3_gather == "per_tensor":  # DeepSpeed 0.3 holds one tensor at a time
        layer_local = largest_param_tensor(model) / plan.tp
    emb_local = embedding_params(model) / plan.tp
    m = plan.num_microbatches
    tokens = plan.micro_batch_size * model.seq_length / plan.cp

    act_layer = activation_bytes_per_layer(model, plan, training)
    if plan.recompute in ("full", "op"):
        # While a layer is recomputed its full activations live; what it kept (its input, or
        # op-level checkpointing's saved outputs) is already counted above, so add the rest.
        none = activation_bytes_per_layer(model, plan, training, recompute="none")
        working = max(0.0, none - act_layer)
    else:
        working = 0.0
    # 1F1B: stage 0 holds min(p, m) micro-batches of its layers. Interleaved: its warm-up runs
    # 2(p-1) + (v-1)p model chunks ahead, so p v + p - 1 chunks of L/v layers are live, i.e.
    # (1 + (p-1)/(p v)) times 1F1B's (Narayanan et al. SC'21, sec. 2.2.2) -- but never more
    # than the m v chunks a step has (with m = p every chunk's forward runs before any backward).
    # The last stage: one micro-batch under 1F1B; interleaved, its warm-up still runs (v-1)p
    # chunks ahead, so (v-1)p + 1 chunks of L/v layers are live (``warmup_chunks`` + 1).
    micro_batches = min(p, m)
    if plan.schedule == "zbv":
        # ZB-V keeps 1F1B's activation memory, p micro-batches of a stage's layers (Qi et al.
        # 2024, their comparison table), and rank 0 holds the first and the last chunk: the
        # embedding and the output layer on one GPU.
        zbv_acts = act_layer * layers_per_stage * micro_batches + working
    if v > 1:  # warmup_chunks + 1 chunks live, inline: this runs for every searched plan
        in_flight = min(m, (min(2 * (p - 1) + (v - 1) * p, m * v) + 1) / v)
        last_in_flight = min(m, (min((v - 1) * p, m * v) + 1) / v)
    else:
        in_flight, last_in_flight = micro_batches, 1
    resident, offloaded = offload_split(layers_per_stage, plan.offload_layers)
    first_acts = act_layer * resident * in_flight + working
    last_acts = act_layer * layers_per_stage * last_in_flight + working
    # Output layer, per vocab shard: 16-bit logits plus the fp32 copy a fused vocab-parallel
    # cross-entropy (fused or not) works on in place (Megatron-LM, NeMo): 6 B per logit. PyTorch's
    # F.cross_entropy on upcast logits also keeps its fp32 log-softmax output and, in the
    # backward, an fp32 gradient of the logits: 14 B. Plus the final-norm and output-GEMM inputs.
    loss_bytes = 14 if training.cross_entropy == "eager" else 6
    logits = tokens * (loss_bytes * model.vocab_size / plan.tp + 4 * model.hidden_size)
    embed_out = (
        tokens
        * model.hidden_size
        * 2
        * (micro_batches if p > 1 else 1)
        / (plan.tp if plan.sequence_parallel else 1)
    )

    # The lazy-gradient walk follows 1F1B / interleaved order; ZB-V's is priced as the plain sum.
    lazy_grads = fsdp_lazy_grads(plan, training) and plan.schedule != "zbv"

    def stage(
        layer_count: int, embed: bool, output: bool, acts: float, buffers: float, name: str
    ) -> MemoryBreakdown:
        params_local, expert_local = layer_params_split(model, plan, layer_count)
        if embed:
            params_local += emb_local
        if output and (not model.tied_embeddings or not embed):
            params_local += emb_local
        w, g, o = _state_bytes(params_local, plan, training, layer_local)
        if expert_local:
            # Routed experts: their optimizer state (and ZeRO-2/3 gradients) sharded over the
            # expert-data-parallel ranks (Megatron-Core's distributed optimizer per expert DP
            # group); DualPipe keeps a second copy of the stage's weights (DeepSeek-V3 Table 2).
            we, ge, oe = _state_bytes(expert_local, plan, training, layer_local, plan.expert_dp)
            w, g, o = w + we, g + ge, o + oe
        if plan.moe_a2a_overlap == "dualpipe":
            w *= 2
        later = 0.0
        points = lazy_grad_points(p, v, m, p - 1 if name == "last" else 0) if lazy_grads else ()
        # one point with every gradient and the logits live is the plain sum: nothing to do
        if points and (len(points) > 1 or points[0][1:] != (v, 1)):
            # FSDP2 creates gradients at backward time: the optimizer's zero_grad (set to None)
            # frees them before each step's first forward, and a chunk's gradient (under PP
            # the unsharded fp32 accumulator, autograd's .grad upcast by FSDP2; without PP the
            # reduce-scattered shard) appears at that chunk's first backward, while backwards
            # free activations. The peak is the schedule's highest sum of the two, not the sum
            # of their highs. What stays: one layer's unsharded gradient on its way to the
            # reduce-scatter (without PP).
            # The output layer's logits and loss buffers (and, without PP, the embedding's
            # output) live only while a micro-batch sits between its last chunk's forward and
            # backward.
            lazy = g if p > 1 else g - DTYPE_BYTES[training.grad_reduce_dtype] * layer_local
            chunk_acts = act_layer * (layer_count if name == "last" else resident) / v
            chunk_grads = lazy / v
            transient = buffers if output else 0.0
            held, made, tail = max(
                points,
                key=lambda pt: pt[0] * chunk_acts + pt[1] * chunk_grads + pt[2] * transient,
            )
            acts = held * chunk_acts + working
            buffers -= transient * (1 - tail)
            later = lazy - made * chunk_grads
            g -= later
        live = w + g + o + acts + buffers
        other = params.runtime_overhead_gib * GiB + params.allocator_fragmentation * live
        return MemoryBreakdown(w, g, o, acts, buffers, other, name, act_layer * offloaded, later)

    if p == 1:
        return stage(model.num_layers, True, True, first_acts, logits + embed_out, "only")
    if plan.schedule == "zbv":
        return stage(layers_per_stage, True, True, zbv_acts, logits + embed_out, "first")
    first = stage(layers_per_stage, True, False, first_acts, embed_out, "first")
    last = stage(layers_per_stage, False, True, last_acts, logits, "last")
    return first if first.total >= last.total else last


def checkpoint_bytes(model: ModelSpec, training: TrainingSpec) -> float:
    """Bytes of one full training checkpoint of the whole job: 16-bit weights, master weights and
    the optimizer moments (Adam: m and v) in ``optimizer_dtype``, i.e. 14 B/param for Adam in
    fp32 mixed precision (Megatron-LM and DCP checkpoints store exactly these), 8 B in bf16."""
    from aihpc.perf.flops import num_params

    o = DTYPE_BYTES[training.optimizer_dtype]
    moments = MOMENTS[training.optimizer]
    return num_params(model) * (2 + o * (1 + moments))
