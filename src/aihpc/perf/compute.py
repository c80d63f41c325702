"""Kernel times: GEMMs and attention on a roofline with size-dependent efficiency, element-wise
work at HBM bandwidth. All times are for one GPU, in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aihpc.perf.flops import layer_gemms, mla_gemms, mla_head_dims, op_sac_saved
from aihpc.perf.numeric import where
from aihpc.perf.params import ModelParams
from aihpc.spec.calibration import Calibration
from aihpc.spec.cluster import GPUSpec
from aihpc.spec.model import ModelSpec
from aihpc.spec.parallel import ParallelPlan
from aihpc.spec.training import DTYPE_BYTES, TrainingSpec

__all__ = [
    "LayerTimes",
    "elementwise_bytes_per_token",
    "gemm_time_s",
    "layer_times",
    "logits_time_s",
    "optimizer_time_s",
]


def gemm_efficiency(
    gpu: GPUSpec, precision: str, gflop: float, params: ModelParams, calibration: Calibration | None
) -> float:
    """Achieved fraction of the dense peak for one GEMM of ``gflop`` GFLOP."""
    peak = gpu.sustained_peak_tflops(precision)
    if calibration is not None and precision in calibration.gemm:
        eff = calibration.gemm[precision].achieved_tflops(gflop) / peak
    else:
        large = gpu.large_gemm_efficiency(precision) or params.gemm_efficiency
        eff = large * gflop / (gflop + params.gemm_half_efficiency_gflop)
    if calibration is not None and calibration.efficiency is not None:
        # a scale fitted to measured runs (aihpc calibrate --runs); never past the peak
        eff = min(1.0, eff * calibration.scale("gemm"))
    return eff


def gemm_time_s(
    m: float,
    n: float,
    k: float,
    gpu: GPUSpec,
    precision: str,
    params: ModelParams,
    calibration: Calibration | None = None,
    batch: float = 1,
) -> float:
    """``batch`` (m x k) @ (k x n) products in one kernel (one GEMM, or torch.bmm / baddbmm):
    the slower of compute, at the efficiency of the whole launch, and memory traffic (each
    product's own operands), plus one launch cost."""
    flops = 2.0 * batch * m * n * k
    eff = gemm_efficiency(gpu, precision, flops / 1e9, params, calibration)
    compute = flops / (gpu.sustained_peak_tflops(precision) * 1e12 * eff)
    elem = 1.0 if precision == "fp8" else 2.0
    traffic = batch * ((m * k + k * n) * elem + m * n * 2.0)
    memory = traffic / (gpu.hbm_bw_GBps * 1e9 * params.hbm_efficiency)
    return max(compute, memory) + params.kernel_overhead_s


def stream_time_s(num_bytes: Any, gpu: GPUSpec, params: ModelParams, kernels: int = 1) -> Any:
    """Memory-bound element-wise work moving ``num_bytes`` through HBM (a float or an array)."""
    return (
        num_bytes / (gpu.hbm_bw_GBps * 1e9 * params.hbm_efficiency)
        + kernels * params.kernel_overhead_s
    )


@dataclass(frozen=True)
class LayerTimes:
    """Compute time of one transformer layer for one micro-batch on one GPU, seconds."""

    fwd_gemm: float
    fwd_attn: float
    fwd_elementwise: float
    bwd_gemm: float
    bwd_attn: float
    bwd_elementwise: float
    fwd_gemm_unsaved_op: float = 0.0  # GEMMs op-level selective checkpointing recomputes
    fwd_modules: float = 0.0  # forward of the plan's recompute_modules, run again in backward

    @property
    def fwd(self) -> float:
        return self.fwd_gemm + self.fwd_attn + self.fwd_elementwise

    @property
    def bwd(self) -> float:
        return self.bwd_gemm + self.bwd_attn + self.bwd_elementwise


def layer_times(
    model: ModelSpec,
    gpu: GPUSpec,
    plan: ParallelPlan,
    training: TrainingSpec,
    params: ModelParams,
    calibration: Calibration | None = None,
    moe: bool = False,
) -> LayerTimes:
    t, cp = plan.tp, plan.cp
    s = model.seq_length
    tokens = plan.micro_batch_size * s / cp  # rows of every GEMM on this GPU
    h, d = model.hidden_size, model.kv_channels
    hq, hkv = model.num_attention_heads * d, model.kv_heads * d
    ffn = model.expert_ffn_hidden_size if moe else model.ffn_hidden_size
    f_in = 2 * ffn if model.ffn_activation == "swiglu" else ffn
    prec = training.precision

    def gemm(m: float, n: float, k: float) -> float:
        return gemm_time_s(m, n, k, gpu, prec, params, calibration)

    if model.is_mla:
        fwd_gemm = 0.0
        for _, n_in, n_out, split in mla_gemms(model):
            if split == "row":
                fwd_gemm += gemm(tokens, n_out, n_in / t)
            else:  # "rep": the down projections run whole on every TP rank
                fwd_gemm += gemm(tokens, n_out / (t if split == "col" else 1), n_in)
    else:
        # Q, K and V run as one fused GEMM (Megatron, TE); the FFN input as one (gate and up).
        fwd_gemm = gemm(tokens, (hq + 2 * hkv) / t, h) + gemm(tokens, h, hq / t)
    stream_moe = 0.0
    modules = plan.recompute_modules
    fwd_modules = 0.0
    if "mla_up_proj" in modules and model.is_mla:
        for name, n_in, n_out, _ in mla_gemms(model):
            if name in ("q_up", "kv_up"):
                fwd_modules += gemm(tokens, n_out / t, n_in)
    if "mlp" in modules and not moe:
        fwd_modules += gemm(tokens, f_in / t, h) + gemm(tokens, h, ffn / t)
    if moe:
        # Shared experts: one dense FFN of num_shared x the expert width, split over TP.
        shared = model.num_shared_experts
        if shared:
            fwd_gemm += gemm(tokens, shared * f_in / t, h) + gemm(tokens, h, shared * ffn / t)
        routed, stream_moe = _routed_expert_fwd(model, gpu, plan, training, params, calibration)
        fwd_gemm += routed
        # What op-level checkpointing recomputes: every other matmul, half of the GEMM time.
        unsaved_op = fwd_gemm / 2
    else:
        # The FFN input as one GEMM (gate and up).
        fwd_gemm += gemm(tokens, f_in / t, h) + gemm(tokens, h, ffn / t)
    if model.is_mla and not moe:
        unsaved_op = fwd_gemm / 2
    elif not moe:
        # What op-level selective checkpointing recomputes: every other matmul, one by one.
        unsaved_op = 0.0
        for i, (_, n_in, n_out, row) in enumerate(layer_gemms(model, moe)):
            if not op_sac_saved(i):
                unsaved_op += (
                    gemm(tokens, n_out, n_in / t) if row else gemm(tokens, n_out / t, n_in)
                )
    # Backward: gradient w.r.t. inputs and w.r.t. weights, each the size of the forward GEMM.
    bwd_gemm = 2 * fwd_gemm

    heads = model.num_attention_heads / t
    if training.attention in ("flash", "flash2"):
        # Causal FlashAttention skips the masked half; the backward recomputes the scores (5
        # matmuls vs 2: 2.5x the forward FLOPs). Under load-balanced CP each rank does 1/cp.
        flops = 4 * tokens * s * heads * d * 0.5
        if model.is_mla:  # scores over the qk width, AV over the v width
            dqk, dv = mla_head_dims(model)
            flops = 2 * tokens * s * heads * (dqk + dv) * 0.5
        eff_f, eff_b = _attention_efficiency(gpu, training, params, calibration)
        peak = gpu.sustained_peak_tflops("bf16") * 1e12
        fwd_attn = flops / (peak * eff_f) + params.kernel_overhead_s
        bwd_attn = 2.5 * flops / (peak * eff_b) + params.kernel_overhead_s
        if training.dropout > 0:  # the kernel draws and applies the mask from its RNG state
            fwd_attn *= 1 + params.fused_attention_dropout_cost
            bwd_attn *= 1 + params.fused_attention_dropout_cost
        attn_stream_fwd = 0.0
    else:
        # Unfused: two batched GEMMs over the full s x s square per head, plus the softmax
        # (and dropout) reading and writing the scores.
        batch = tokens / s * heads  # Megatron: one baddbmm for QK^T, one bmm for PV
        bmm = gemm_time_s(s, s, d, gpu, "bf16", params, calibration, batch) + gemm_time_s(
            s, d, s, gpu, "bf16", params, calibration, batch
        )
        fwd_attn = bmm
        bwd_attn = 2 * bmm
        drop = training.dropout > 0
        attn_stream_fwd = tokens * heads * s * (2 + 2 + (5 if drop else 0))

    if moe:  # the shared experts' activation; the routed ones are in stream_moe
        ffn = model.num_shared_experts * ffn
        f_in = 2 * ffn if model.ffn_activation == "swiglu" else ffn
    per_token = elementwise_bytes_per_token(model, plan, training, ffn, f_in)
    # The attention core (score GEMMs plus, when unfused, the softmax/dropout traffic) is what
    # selective recompute re-runs, so it is kept in fwd_attn.
    softmax = stream_time_s(attn_stream_fwd, gpu, params, kernels=2) if attn_stream_fwd else 0.0
    if "layernorm" in modules:  # each norm reads and writes h per token
        sp = t if plan.sequence_parallel else 1
        fwd_modules += stream_time_s(tokens * 8 * h / sp, gpu, params, kernels=2)
    if "moe_act" in modules and moe:  # the experts' activation: read f_in, write ffn per copy
        fe = model.expert_ffn_hidden_size
        act = 2 * ((2 * fe if model.ffn_activation == "swiglu" else fe) + fe) / plan.etp
        fwd_modules += stream_time_s(routed_tokens(model, plan, training) * act, gpu, params)
    fwd_stream = stream_time_s(tokens * per_token, gpu, params, kernels=6)
    bwd_stream = stream_time_s(2 * tokens * per_token, gpu, params, kernels=10)
    if moe:  # router, permute, expert activation, unpermute: forward 5 kernels, backward twice
        fwd_stream += stream_time_s(stream_moe, gpu, params, kernels=5)
        bwd_stream += stream_time_s(2 * stream_moe, gpu, params, kernels=10)
    return LayerTimes(
        fwd_gemm,
        fwd_attn + softmax,
        fwd_stream,
        bwd_gemm,
        bwd_attn + 2 * softmax,
        bwd_stream,
        unsaved_op,
        fwd_modules,
    )


def _attention_efficiency(
    gpu: GPUSpec, training: TrainingSpec, params: ModelParams, calibration: Calibration | None
) -> tuple[float, float]:
    """(forward, backward) fraction of the 16-bit peak the fused attention kernel reaches: the
    catalog's figure for the part, else the constant; times a scale fitted to measured runs."""
    eff_f, eff_b = gpu.attention_efficiency(training.attention)
    eff_f, eff_b = eff_f or params.attention_efficiency, eff_b or params.attention_efficiency
    if calibration is not None and calibration.efficiency is not None:
        k = calibration.scale("attention")
        eff_f, eff_b = min(1.0, eff_f * k), min(1.0, eff_b * k)
    return eff_f, eff_b


def routed_tokens(model: ModelSpec, plan: ParallelPlan, training: TrainingSpec) -> float:
    """Token copies the busiest GPU's routed experts take per micro-batch and MoE layer.

    The layer's input is split over tp x cp ranks (sequence parallel); each token goes to
    top_k experts. With parallel folding the expert grid etp x ep spreads those copies evenly
    over the stage's ranks, each of an expert's etp ranks seeing all of its tokens: top_k x etp
    copies per local token. The busiest rank takes ``moe_imbalance`` times that, at most the
    capacity factor's cap (token-dropping runs)."""
    tokens = plan.micro_batch_size * model.seq_length / (plan.cp * plan.tp)
    load = training.moe_imbalance
    if model.moe_capacity_factor is not None:
        load = min(load, model.moe_capacity_factor)
    return tokens * model.moe_top_k * plan.etp * load


def _routed_expert_fwd(
    model: ModelSpec,
    gpu: GPUSpec,
    plan: ParallelPlan,
    training: TrainingSpec,
    params: ModelParams,
    calibration: Calibration | None,
) -> tuple[float, float]:
    """(forward GEMM seconds, forward element-wise HBM bytes) of one MoE layer's router and
    routed experts on the busiest GPU.

    The E / ep local experts run as one grouped GEMM per projection (TE GroupedLinear, CUTLASS
    grouped GEMM): each expert's product is priced at the tokens it actually sees, so its
    size-dependent efficiency is that of a GEMM of tokens-per-expert rows, and every expert's
    weights are read once. The router is a GEMM of the local tokens onto the experts."""
    h, ffn = model.hidden_size, model.expert_ffn_hidden_size
    f_in = 2 * ffn if model.ffn_activation == "swiglu" else ffn
    prec = training.precision
    local = model.num_experts / plan.ep
    copies = routed_tokens(model, plan, training)
    per_expert = copies / local

    def grouped(n: float, k: float) -> float:
        one = gemm_time_s(per_expert, n, k, gpu, prec, params, calibration)
        return local * (one - params.kernel_overhead_s) + params.kernel_overhead_s

    tokens = plan.micro_batch_size * model.seq_length / (plan.cp * plan.tp)
    router = gemm_time_s(tokens, model.num_experts, h, gpu, "bf16", params, calibration)
    gemms = grouped(f_in / plan.etp, h) + grouped(h, ffn / plan.etp) + router
    # Bytes: router scores (fp32 logits, softmax / top-k), permute (read the token, write each
    # copy), the expert activation (read f_in, write ffn per copy), unpermute (read each copy
    # and its weight, write the token), all 16-bit.
    act = 2 * (f_in + ffn) / plan.etp
    moved = tokens * model.num_experts * 4 * 3 + 2 * (tokens * h + copies * h) * 2
    moved += copies * act
    if prec == "fp8":  # each expert GEMM's input cast to FP8 (read 2 B, write 1 B per value)
        moved += copies * 3 * (h + ffn / plan.etp)
    return gemms, moved


def elementwise_bytes_per_token(
    model: ModelSpec, plan: ParallelPlan, training: TrainingSpec, ffn: int, f_in: int
) -> float:
    """HBM bytes one token moves through a layer's element-wise ops in the forward pass.

    Fused (Megatron/TE kernels, torch.compile): each norm reads and writes h (2 x 4h bytes),
    each residual add fused with bias/dropout reads 2h and writes h (2 x 6h), the activation
    reads f_in and writes ffn, RoPE reads and writes q and k, hidden dropout writes two 1-byte
    masks. Eager PyTorch runs one kernel per op: RMSNorm upcasts to fp32 and runs pow, mean,
    rsqrt, two multiplies and a downcast (~36h bytes instead of 4h), SwiGLU is silu then
    multiply (10 ffn instead of 6 ffn), squared ReLU two kernels, RoPE a complex multiply in
    fp32 (20 instead of 4 bytes per q/k element).
    """
    h, d, t = model.hidden_size, model.kv_channels, plan.tp
    sp = t if plan.sequence_parallel else 1
    qk = (model.num_attention_heads + model.kv_heads) * d / t
    rope = model.position_embedding == "rope"
    if training.fused_kernels:
        norms, act, rope_b = 8 * h, 2 * (f_in + ffn), 4 * qk
    else:
        eager_act = {"swiglu": 10 * ffn, "relu2": 8 * ffn, "gelu": 4 * ffn}
        norms, act, rope_b = 72 * h, eager_act[model.ffn_activation], 20 * qk
    # Hidden dropout (bias-dropout-add after attention and after the MLP) writes a 1-byte mask
    # per element in the forward, which the backward reads; attention dropout inside a fused
    # kernel regenerates its mask from the RNG state and moves no extra bytes (its RNG cost
    # is not priced: docs/performance-model.md).
    masks = 2 * h if training.dropout > 0 else 0
    per_token = (norms + 12 * h + masks) / sp + act / t + (rope_b if rope else 0.0)
    if training.precision == "fp8":  # cast each GEMM's activation input (read 2 B, write 1 B)
        per_token += 3 * (2 * h + (model.num_attention_heads * d + ffn) / t)
    return per_token


def logits_time_s(
    model: ModelSpec,
    gpu: GPUSpec,
    plan: ParallelPlan,
    training: TrainingSpec,
    params: ModelParams,
    calibration: Calibration | None = None,
) -> tuple[float, float]:
    """(forward, backward) of the output layer and the cross-entropy, one micro-batch."""
    tokens = plan.micro_batch_size * model.seq_length / plan.cp
    v = model.vocab_size / plan.tp
    # The output GEMM runs in 16-bit in Megatron, NeMo and torchtitan even under FP8 recipes.
    g = gemm_time_s(tokens, v, model.hidden_size, gpu, "bf16", params, calibration)
    # HBM bytes per logit (forward, backward), counted from each implementation's passes.
    # fused (Megatron-Core's jit-fused vocab-parallel CE): upcast + max (2 + 4), exp + sum
    # (4 + 4), normalise in place (4 + 4); backward: gradient in place (4 + 4), downcast (4 + 2).
    # vocab_parallel (unfused): upcast (2 + 4), max (4), subtract, exp and normalise in place
    # (3 x 8), sum (4); backward the same as fused. eager F.cross_entropy on upcast logits:
    # upcast (2 + 4), log-softmax's max, sum and write passes (4 + 4 + 4 + 4); backward: zero-fill
    # (4), log-softmax backward (4 + 4 + 4 + 4), downcast (4 + 2) -- measured on H200 for Llama 3
    # 8B's 128K vocabulary: 23 and 31 B (benchmarks/layer_time.py).
    fwd_b, bwd_b = {"fused": (22, 14), "vocab_parallel": (38, 14), "eager": (22, 26)}[
        training.cross_entropy
    ]
    loss_f = stream_time_s(tokens * v * fwd_b, gpu, params, kernels=3)
    loss_b = stream_time_s(tokens * v * bwd_b, gpu, params, kernels=3)
    return g + loss_f, 2 * g + loss_b


def optimizer_time_s(
    params_local: Any,
    zero_stage: Any,
    shard: Any,
    gpu: GPUSpec,
    params: ModelParams,
    training: TrainingSpec,
) -> Any:
    """Fused Adam: read master weight, gradient, m and v and write weight, m, v and the 16-bit
    copy (fp32 states: 16 + 12 + 2 bytes per parameter). One plan or arrays of plans."""
    updated = params_local / where(zero_stage >= 1, shard, 1)
    o = DTYPE_BYTES[training.optimizer_dtype]
    g = DTYPE_BYTES[training.grad_reduce_dtype]
    per_param = (3 * o + g) + 3 * o + 2
    return stream_time_s(updated * per_param, gpu, params, kernels=4)
