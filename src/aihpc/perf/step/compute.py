"""Kernel times of a layer by kernel class: its GEMMs (gemm.py's roofline), attention by kernel
implementation, element-wise work and modules at HBM bandwidth, the routed experts, the logits
and the optimizer. All times are for one GPU, in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from aihpc.perf.step import dtensor_host, eager_host, page_faults
from aihpc.perf.step.attention_kernels import (
    FUSED_KERNELS,
    head_dim_factor,
    kernel_efficiency,
    kernel_tokens,
    window_keys,
)
from aihpc.perf.step.flops import layer_gemms, mla_gemms, mla_head_dims, op_sac_saved
from aihpc.perf.step.gemm import gemm_bwd_s, gemm_time_s, stream_time_s
from aihpc.perf.step.host_issue import with_host_time
from aihpc.perf.step.moe_host import moe_host_excess_s
from aihpc.perf.step.moe_kernels import routed_expert_gemms, routed_tokens
from aihpc.perf.step.moe_stack import stack_of
from aihpc.perf.step.numeric import where
from aihpc.perf.step.params import ModelParams
from aihpc.runspec.calibration import Calibration
from aihpc.runspec.cluster import GPUSpec
from aihpc.runspec.host_cpu import host_cpu_ratio
from aihpc.runspec.model import ModelSpec
from aihpc.runspec.parallel import ParallelPlan
from aihpc.runspec.training import DTYPE_BYTES, TrainingSpec

__all__ = [
    "LayerTimes",
    "attention_times",
    "elementwise_bytes_per_token",
    "elementwise_times",
    "gemm_times",
    "layer_times",
    "logits_time_s",
    "module_times",
    "optimizer_time_s",
]


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
    fwd_host: float = 0.0  # an eager MoE layer's wait on its host beyond the GPU time
    bwd_host: float = 0.0
    # An MoE layer's MoE block (shared and routed experts' GEMMs, the router's, permute,
    # activation and unpermute traffic), the rest being its attention side: what Megatron-Core's
    # 1F1B A2A overlap pairs the other micro-batch's transfers with (perf/step/moe_overlap.py).
    mlp_fwd: float = 0.0
    mlp_bwd: float = 0.0

    @property
    def fwd(self) -> float:
        return self.fwd_gemm + self.fwd_attn + self.fwd_elementwise + self.fwd_host

    @property
    def bwd(self) -> float:
        return self.bwd_gemm + self.bwd_attn + self.bwd_elementwise + self.bwd_host


def layer_times(
    model: ModelSpec,
    gpu: GPUSpec,
    plan: ParallelPlan,
    training: TrainingSpec,
    params: ModelParams,
    calibration: Calibration | None = None,
    moe: bool = False,
) -> LayerTimes:
    """One layer's kernel times for one micro-batch, by kernel class: the GEMMs
    (``gemm_times``), the attention core (``attention_times``), the element-wise work
    (``elementwise_times``), and what the plan's recompute modules run again (``module_times``).
    ``moe``: an MoE layer (shared and routed experts instead of the dense FFN)."""
    k = _Kernels(model, gpu, plan, training, params, calibration, moe)
    fwd_gemm, bwd_gemm, unsaved_op, stream_moe = gemm_times(k)
    fwd_attn, bwd_attn, attn_stream_fwd = attention_times(k)
    # The attention core (score GEMMs plus, when unfused, the softmax/dropout traffic) is what
    # selective recompute re-runs, so it is kept in fwd_attn.
    softmax = stream_time_s(attn_stream_fwd, gpu, params, kernels=2) if attn_stream_fwd else 0.0
    soft_f, soft_b = softmax, 2 * softmax
    if gpu.host_is_device and plan.cp > 1 and eager_host.eager(training):
        # the trainer's ring attention on a CPU: its fp32 element-wise passes (eager_host.py)
        ring = eager_host.ring_attention_bytes(
            k.tokens, model.num_attention_heads / plan.tp, model.seq_length, model.kv_channels,
            plan.cp,
        )  # fmt: skip
        soft_f, soft_b = (stream_time_s(x, gpu, params, kernels=0) for x in ring)
    fwd_stream, bwd_stream = elementwise_times(k, stream_moe)
    if not moe and eager_host.eager(training) and page_faults.priced(gpu):
        # the faults of the layer's fresh large tensors on a CPU host (perf/step/page_faults.py)
        fresh = page_faults.layer_bytes(model, k.tokens, plan.tp, plan.sequence_parallel)
        fwd_stream += page_faults.fault_time_s(fresh[0], gpu)
        bwd_stream += page_faults.fault_time_s(fresh[1], gpu)
    lt = LayerTimes(
        fwd_gemm,
        fwd_attn + soft_f,
        fwd_stream,
        bwd_gemm,  # gradients w.r.t. inputs and weights, each the forward's size
        bwd_attn + soft_b,
        bwd_stream,
        unsaved_op,
        module_times(k),
    )
    if moe:
        attn_f, attn_b = attention_gemm_times(k)
        moe_f = fwd_gemm - attn_f + stream_time_s(stream_moe, gpu, params, kernels=5)
        moe_b = bwd_gemm - attn_b + stream_time_s(2 * stream_moe, gpu, params, kernels=10)
        if gpu.host_is_device and eager_host.eager(training):
            # the trainer's per-expert loop on a CPU: its cat / stack copies (eager_host.py)
            local, copies = model.num_experts / plan.ep, routed_tokens(model, plan, training)
            extra = eager_host.moe_loop_copy_bytes(model, copies, local, plan.etp)
            cf, cb = (stream_time_s(x, gpu, params, kernels=0) for x in extra)
            moe_f, moe_b = moe_f + cf, moe_b + cb
            lt = replace(lt, fwd_elementwise=fwd_stream + cf, bwd_elementwise=bwd_stream + cb)
        lt = replace(lt, mlp_fwd=moe_f, mlp_bwd=moe_b)
    stack = stack_of(training)
    host = stack.host if stack is not None else training.moe_dispatcher
    if moe and training.cuda_graphs == "none" and host != "none":
        # An eager MoE layer runs no faster than its host issues it (perf/step/moe_host.py);
        # ops counted for Megatron-Core's dispatchers only (data/moe_stacks.toml, host).
        local = model.num_experts / plan.ep
        prec = training.precision
        ratio = host_cpu_ratio(gpu.id)  # a Grace host issues each op slower (runspec/host_cpu.py)
        waits = moe_host_excess_s(lt.fwd, lt.bwd, host, prec, local, params, lt.mlp_fwd, ratio)
        lt = replace(lt, fwd_host=waits[0], bwd_host=waits[1])
    # the host's issue of the layer's kernels and DTensor's dispatch (perf/step/host_issue.py);
    # an eager MoE layer's own ops are moe_host's where it priced them above
    moe_priced = moe and training.cuda_graphs == "none" and host != "none"
    local = model.num_experts / plan.ep if moe else None
    return with_host_time(lt, gpu, plan, training, params, calibration, moe_priced, local)


@dataclass(frozen=True)
class _Kernels:
    """What every kernel-class term of a layer reads: the specs and the GEMMs' row count."""

    model: ModelSpec
    gpu: GPUSpec
    plan: ParallelPlan
    training: TrainingSpec
    params: ModelParams
    calibration: Calibration | None
    moe: bool

    @property
    def tokens(self) -> float:
        """Rows of every GEMM on this GPU: the micro-batch's tokens of this CP rank."""
        return self.plan.micro_batch_size * self.model.seq_length / self.plan.cp

    @property
    def ffn(self) -> tuple[int, int]:
        """(FFN width, FFN input GEMM width: gate and up fused for SwiGLU) of the layer."""
        m = self.model
        ffn = m.expert_ffn_hidden_size if self.moe else m.ffn_hidden_size
        return ffn, 2 * ffn if m.ffn_activation == "swiglu" else ffn

    def gemm(self, m: float, n: float, k: float) -> float:
        p = self.training.precision
        return gemm_time_s(m, n, k, self.gpu, p, self.params, self.calibration)

    def pair(self, m: float, n: float, k: float) -> tuple[float, float]:
        """(forward, backward) of a linear whose forward is (m x k) @ (k x n)."""
        return self.gemm(m, n, k), gemm_bwd_s(self.gemm, m, n, k)


def _pairs(
    k: _Kernels, a: tuple[float, ...], b: tuple[float, ...], bwd: float = 0.0
) -> tuple[float, float]:
    """(forward of two linears, ``bwd`` plus their backward, added one GEMM at a time)."""
    fa, ba = k.pair(*a)
    fb, bb = k.pair(*b)
    return fa + fb, bwd + ba + bb


def attention_gemm_times(k: _Kernels) -> tuple[float, float]:
    """(forward, backward) GEMM seconds of one layer's attention projections: QKV fused, as
    Megatron and TE run them, and the output projection; MLA's projections by their split."""
    model, t, tokens = k.model, k.plan.tp, k.tokens
    h, d = model.hidden_size, model.kv_channels
    hq, hkv = model.num_attention_heads * d, model.kv_heads * d
    fwd_gemm = bwd_gemm = 0.0
    if model.is_mla:
        for _, n_in, n_out, split in mla_gemms(model):
            if split == "row":
                fwd, bwd = k.pair(tokens, n_out, n_in / t)
            else:  # "rep": the down projections run whole on every TP rank
                fwd, bwd = k.pair(tokens, n_out / (t if split == "col" else 1), n_in)
            fwd_gemm, bwd_gemm = fwd_gemm + fwd, bwd_gemm + bwd
        return fwd_gemm, bwd_gemm
    return _pairs(k, (tokens, (hq + 2 * hkv) / t, h), (tokens, h, hq / t))


def gemm_times(k: _Kernels) -> tuple[float, float, float, float]:
    """(forward GEMM seconds, backward GEMM seconds, the part op-level checkpointing
    recomputes, the routed experts' element-wise HBM bytes) of one layer: attention projections
    (QKV fused, as Megatron and TE run them; MLA's projections by their split), then the dense
    FFN (input GEMM with gate and up fused) or the MoE layer's shared and routed experts. Each
    backward GEMM is priced at its own contraction length (``gemm_bwd_s``)."""
    model, plan, t, tokens = k.model, k.plan, k.plan.tp, k.tokens
    h = model.hidden_size
    ffn, f_in = k.ffn
    # Forward sums keep the order the function has always added them in (bit-for-bit results).
    fwd_gemm, bwd_gemm = attention_gemm_times(k)
    stream_moe = 0.0
    if k.moe:
        # Shared experts: one dense FFN of num_shared x the expert width, split over TP.
        shared = model.num_shared_experts
        if shared:
            shapes = ((tokens, shared * f_in / t, h), (tokens, h, shared * ffn / t))
            fwd, bwd = _pairs(k, *shapes, bwd=bwd_gemm)
            fwd_gemm, bwd_gemm = fwd_gemm + fwd, bwd
        args = (model, k.gpu, plan, k.training, k.params, k.calibration)
        routed, routed_bwd, stream_moe = routed_expert_gemms(*args)
        fwd_gemm, bwd_gemm = fwd_gemm + routed, bwd_gemm + routed_bwd
    else:
        fwd, bwd = _pairs(k, (tokens, f_in / t, h), (tokens, h, ffn / t), bwd=bwd_gemm)
        fwd_gemm, bwd_gemm = fwd_gemm + fwd, bwd
    if k.moe or model.is_mla:
        # What op-level checkpointing recomputes: every other matmul, half of the GEMM time.
        return fwd_gemm, bwd_gemm, fwd_gemm / 2, stream_moe
    # What op-level selective checkpointing recomputes: every other matmul, one by one.
    unsaved_op = 0.0
    for i, (_, n_in, n_out, row) in enumerate(layer_gemms(model, k.moe)):
        if not op_sac_saved(i):
            unsaved_op += (
                k.gemm(tokens, n_out, n_in / t) if row else k.gemm(tokens, n_out / t, n_in)
            )
    return fwd_gemm, bwd_gemm, unsaved_op, stream_moe


def attention_times(k: _Kernels) -> tuple[float, float, float]:
    """(forward, backward, forward softmax/dropout HBM bytes when unfused) of one layer's
    attention core (``training.attention``: a fused kernel class, perf/step/attention_kernels.py,
    or unfused). With sliding-window layers (``model.attention_window``) a fused kernel's time
    is the average over the model's full and windowed layers; an unfused one computes the
    whole masked square either way."""
    model, training = k.model, k.training
    s = model.seq_length
    if training.attention in FUSED_KERNELS:
        # Causal FlashAttention skips the masked half (s / 2 keys per query on average).
        fwd_attn, bwd_attn = _fused_attention(k, s / 2, kernel_tokens(s, k.plan.cp), full=True)
        windowed = model.windowed_layers / model.num_layers
        if windowed and model.attention_window is not None and model.attention_window < s:
            # A windowed layer's query tiles loop over the window's keys only: its kernel runs
            # at the efficiency of a call that long (checked against NVIDIA's cuDNN benchmark
            # in tests/perf/test_attention_window.py).
            w = model.attention_window
            kv = min(float(w), kernel_tokens(s, k.plan.cp))
            win_f, win_b = _fused_attention(k, window_keys(s, w), kv, full=False)
            fwd_attn += windowed * (win_f - fwd_attn)
            bwd_attn += windowed * (win_b - bwd_attn)
        return fwd_attn, bwd_attn, 0.0
    # Unfused: two batched GEMMs over the full s x s square per head, plus the softmax
    # (and dropout) reading and writing the scores.
    gpu, params, tokens, d = k.gpu, k.params, k.tokens, model.kv_channels
    heads = model.num_attention_heads / k.plan.tp
    batch = tokens / s * heads  # Megatron: one baddbmm for QK^T, one bmm for PV
    cal = k.calibration
    bmm = gemm_time_s(s, s, d, gpu, "bf16", params, cal, batch) + gemm_time_s(
        s, d, s, gpu, "bf16", params, cal, batch
    )
    drop = training.dropout > 0
    return bmm, 2 * bmm, tokens * heads * s * (2 + 2 + (5 if drop else 0))


def _fused_attention(k: _Kernels, keys: float, kv_tokens: float, full: bool) -> tuple[float, float]:
    """(forward, backward) of one layer's fused attention kernel when each query meets
    ``keys`` keys on average, at the efficiency of calls over ``kv_tokens`` keys. The backward
    recomputes the scores (5 matmuls vs 2: 2.5x the forward FLOPs); under load-balanced CP each
    rank holds 1/cp of the queries. A ``full`` layer's kernel runs at its head dimension's share
    of the head-dim-128 figures (``head_dim_factor``, measured on long key loops); a windowed
    one's figure was measured at head dim 64 on the window curve itself
    (tests/perf/test_attention_window.py), and a part whose figures ``aihpc calibrate --local``
    timed on the spec model's own calls (``gpu.attention_tokens``) has its head dim in them."""
    model, gpu, params, training = k.model, k.gpu, k.params, k.training
    heads = model.num_attention_heads / k.plan.tp
    flops = 4 * k.tokens * keys * heads * model.kv_channels
    if model.is_mla:  # scores over the qk width, AV over the v width
        dqk, dv = mla_head_dims(model)
        flops = 2 * k.tokens * keys * heads * (dqk + dv)
    eff_f, eff_b = _attention_efficiency(gpu, training, params, k.calibration, kv_tokens)
    if full and gpu.attention_tokens is None:
        d = min(mla_head_dims(model)) if model.is_mla else model.kv_channels
        hd_f, hd_b = head_dim_factor(training.attention, d)
        eff_f, eff_b = eff_f * hd_f, eff_b * hd_b
    peak = gpu.sustained_peak_tflops("bf16") * 1e12
    fwd = flops / (peak * eff_f) + params.kernel_overhead_s
    bwd = 2.5 * flops / (peak * eff_b) + params.kernel_overhead_s
    if training.dropout > 0:  # the kernel draws and applies the mask from its RNG state
        fwd *= 1 + params.fused_attention_dropout_cost
        bwd *= 1 + params.fused_attention_dropout_cost
    return fwd, bwd


def elementwise_times(k: _Kernels, stream_moe: float) -> tuple[float, float]:
    """(forward, backward) of one layer's element-wise work at HBM bandwidth (norms, residual
    adds, activation, RoPE, casts, masks: ``elementwise_bytes_per_token``); an MoE layer adds
    its router, permute, expert activation and unpermute (``stream_moe`` bytes): forward 5
    kernels, backward twice. The backward moves twice the forward's bytes."""
    model, gpu, params = k.model, k.gpu, k.params
    ffn, f_in = k.ffn
    if k.moe:  # the shared experts' activation; the routed ones are in stream_moe
        ffn = model.num_shared_experts * ffn
        f_in = 2 * ffn if model.ffn_activation == "swiglu" else ffn
    per_token = elementwise_bytes_per_token(model, k.plan, k.training, ffn, f_in)
    fwd_stream = stream_time_s(k.tokens * per_token, gpu, params, kernels=6)
    bwd_stream = stream_time_s(2 * k.tokens * per_token, gpu, params, kernels=10)
    if k.moe:
        fwd_stream += stream_time_s(stream_moe, gpu, params, kernels=5)
        bwd_stream += stream_time_s(2 * stream_moe, gpu, params, kernels=10)
    return fwd_stream, bwd_stream


def module_times(k: _Kernels) -> float:
    """Forward of the plan's ``recompute_modules``, run again in the backward: MLA's query and
    key-value up projections, the dense FFN, the norms (each reads and writes h per token), the
    routed experts' activation (reads f_in, writes ffn per copy)."""
    model, plan, t, tokens, h = k.model, k.plan, k.plan.tp, k.tokens, k.model.hidden_size
    modules, fwd_modules = plan.recompute_modules, 0.0
    if "mla_up_proj" in modules and model.is_mla:
        for name, n_in, n_out, _ in mla_gemms(model):
            if name in ("q_up", "kv_up"):
                fwd_modules += k.gemm(tokens, n_out / t, n_in)
    if "mlp" in modules and not k.moe:
        ffn, f_in = k.ffn
        fwd_modules += k.gemm(tokens, f_in / t, h) + k.gemm(tokens, h, ffn / t)
    if "layernorm" in modules:
        sp = t if plan.sequence_parallel else 1
        fwd_modules += stream_time_s(tokens * 8 * h / sp, k.gpu, k.params, kernels=2)
    if "moe_act" in modules and k.moe:
        fe = model.expert_ffn_hidden_size
        act = 2 * ((2 * fe if model.ffn_activation == "swiglu" else fe) + fe) / plan.etp
        moved = routed_tokens(model, plan, k.training) * act
        fwd_modules += stream_time_s(moved, k.gpu, k.params)
    return fwd_modules


def _attention_efficiency(
    gpu: GPUSpec,
    training: TrainingSpec,
    params: ModelParams,
    calibration: Calibration | None,
    kv_tokens: float,
) -> tuple[float, float]:
    """(forward, backward) fraction of the 16-bit peak the fused attention kernel reaches on
    calls over ``kv_tokens`` keys: the catalog's figures for the part (else the constant), for
    the run's kernel class and call length (perf/step/attention_kernels.py: the curve anchored at
    the length the part's figures were measured at, ``gpu.attention_tokens``); times a scale
    fitted to measured runs."""
    best = gpu.attention_efficiency("flash")
    fa2 = gpu.attention_efficiency("flash2")
    best = (best[0] or params.attention_efficiency, best[1] or params.attention_efficiency)
    fa2 = (fa2[0] or best[0], fa2[1] or best[1])
    halves = (gpu.attention_half_fwd_tokens, gpu.attention_half_bwd_tokens)
    eff_f, eff_b = kernel_efficiency(
        training.attention, best, fa2, kv_tokens, gpu.attention_tokens, halves
    )
    if calibration is not None and calibration.efficiency is not None:
        k = calibration.scale("attention")
        eff_f, eff_b = min(1.0, eff_f * k), min(1.0, eff_b * k)
    return eff_f, eff_b


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
    def gemm(m: float, n: float, k: float) -> float:
        return gemm_time_s(m, n, k, gpu, "bf16", params, calibration)

    g, g_bwd = gemm(tokens, v, model.hidden_size), gemm_bwd_s(gemm, tokens, v, model.hidden_size)
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
    fwd, bwd = g + loss_f, g_bwd + loss_b
    # the embedding's, final norm's, output layer's and loss's host issue when eager
    # (perf/step/eager_host.py), and under eager tensor parallel their DTensor dispatch and the
    # loss parallel's (perf/step/dtensor_host.py)
    host_f, host_b = eager_host.outside_host_s(training, params)
    if eager_host.eager_outside(training) and page_faults.priced(gpu):
        fresh = page_faults.outside_bytes(model, tokens, plan.tp)
        fwd += page_faults.fault_time_s(fresh[0], gpu)
        bwd += page_faults.fault_time_s(fresh[1], gpu)
    if training.dtensor_dispatch == "eager" and plan.tp > 1:
        op_s = dtensor_host.dtensor_op_s(params, calibration)
        host_f += dtensor_host.OUTSIDE_FWD_OPS * op_s
        host_b += dtensor_host.OUTSIDE_BWD_OPS * op_s
    fwd_x = eager_host.pass_excess_s(fwd, host_f, gpu) if host_f else 0.0
    bwd_x = eager_host.pass_excess_s(bwd, host_b, gpu) if host_b else 0.0
    return fwd + fwd_x, bwd + bwd_x


def optimizer_time_s(
    params_local: Any,
    zero_stage: Any,
    shard: Any,
    gpu: GPUSpec,
    params: ModelParams,
    training: TrainingSpec,
    kernels: int = 4,
) -> Any:
    """Fused Adam: read master weight, gradient, m and v and write weight, m, v and the 16-bit
    copy (fp32 states: 16 + 12 + 2 bytes per parameter), in ``kernels`` launches. One plan or
    arrays of plans."""
    updated = params_local / where(zero_stage >= 1, shard, 1)
    o = DTYPE_BYTES[training.optimizer_dtype]
    g = DTYPE_BYTES[training.grad_reduce_dtype]
    per_param = (3 * o + g) + 3 * o + 2
    return stream_time_s(updated * per_param, gpu, params, kernels=kernels)
