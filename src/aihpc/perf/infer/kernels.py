"""Kernel times of one serving GPU for one engine step, by kernel class: the layer GEMMs on a
roofline (weights read at the weight dtype, FLOPs at the part's GEMM efficiency), attention
over prompts (FLOPs at the fused kernel's efficiency, as training prices it) and over cached
contexts (KV bytes at HBM bandwidth, or FLOPs where they are larger), the routed experts
(the experts a step touches, their weights read once), element-wise work, and launches.
All times in seconds, for one GPU of one pipeline stage, summed over that stage's layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from aihpc.perf.infer.kv import (
    ServingPlan,
    kv_elems_per_token_layer,
    kv_heads_per_gpu,
    stage_layer_counts,
)
from aihpc.perf.infer.routing import routing_imbalance_floor
from aihpc.perf.step.attention_kernels import head_dim_factor, kernel_efficiency
from aihpc.perf.step.flops import mla_gemms, mla_head_dims, mlp_params
from aihpc.perf.step.gemm import gemm_efficiency
from aihpc.perf.step.params import ModelParams
from aihpc.runspec.calibration import Calibration
from aihpc.runspec.cluster import GPUSpec
from aihpc.runspec.model import ModelSpec

__all__ = [
    "Engine",
    "Work",
    "attention_decode_s",
    "attention_prefill_s",
    "busiest_expert_share",
    "expert_rows",
    "gemm_s",
]

# Kernels a layer launches in one step with fused kernels (norm, QKV, RoPE + cache write,
# attention, output projection, residual + norm, gate-up, activation, down, residual): the
# launches a serving engine's CUDA graph still pays as gaps between kernels. An MoE layer adds
# the router, top-k, permute, the grouped GEMMs' activation and the un-permute.
KERNELS_PER_LAYER = 10
KERNELS_PER_MOE_LAYER = 16
# Where the host's CPU is the device it runs the trainer's eager Llama (runtime/model.py), op by
# op, each op's dispatch before its work: the aten calls (views included) one incremental step
# dispatches in a layer, by kind of step, and outside the layers (embedding, the RoPE rows and
# the cache's bookkeeping, final norm, output), counted with a TorchDispatchMode in
# tests/perf/infer/test_cpu_host.py (which fails if the model's count changes).
EAGER_OPS_PER_LAYER = {"prefill": 70, "decode": 68}
EAGER_OPS_OUTSIDE = 26
# Rows of a GEMM's M dimension one tensor-core instruction covers: Hopper's wgmma computes 64
# rows per warpgroup (PTX ISA, "wgmma.mma_async": shape m64nNk16), Ampere's tiles are 64 or 128
# rows too, so a GEMM of m tokens does the work of ceil(m / 64) x 64 rows. It matters in decode,
# where m is the batch (m = 200 computes 256 rows); prefill's thousands of rows lose little.
GEMM_M_TILE = 64
# M tiles of the fused-MoE grouped GEMM of a serving engine, which picks the tile for the rows
# each expert gets: vLLM's fused_moe Triton kernel takes BLOCK_SIZE_M 16 where the batch's
# tokens are no more than the experts (``get_default_config``: ``M <= E``) and, for its Marlin
# path, the smallest of 8 to 64 rows that an expert's mean share fills
# (vllm/model_executor/layers/fused_moe/fused_moe.py, commit 000d145). Its tuned table for
# E=128, N=192 on H100 (configs/E=128,N=192,device_name=NVIDIA_H100_80GB_HBM3.json, Qwen3-30B-A3B
# at TP4) takes 16 rows up to M = 128 tokens (8 copies an expert), 32 at 256 and 64 at 512-1024:
# a tile near an expert's mean rows, one size up where the mean fills it. 16 rows is the
# mma.sync m16n8k16 instruction's M (PTX ISA), the smallest tile a tensor-core GEMM computes.
MOE_M_TILES = (16, 32, 64)


@dataclass(frozen=True)
class Engine:
    """What prices one GPU: the model, the part, the plan and the model's constants."""

    model: ModelSpec
    gpu: GPUSpec
    plan: ServingPlan
    params: ModelParams
    calibration: Calibration | None = None
    act_dtype: str = "bf16"

    @property
    def precision(self) -> str:
        """GEMM precision: FP8 weights run FP8 GEMMs (W8A8) where the part has FP8 peaks;
        int8 / int4 weights are dequantised into 16-bit GEMMs (weight-only formats)."""
        if self.plan.weight_dtype == "fp8" and self.gpu.fp8_tflops:
            return "fp8"
        # fp32 (a CPU host): priced on the part's 16-bit peak, which `calibrate --local` sets
        # to the host's best fp32 GEMM rate (its GEMM table is written for both)
        return "fp16" if self.act_dtype == "fp16" else "bf16"

    @property
    def act_bytes(self) -> float:
        return 4.0 if self.act_dtype == "fp32" else 2.0

    @property
    def hbm_Bps(self) -> float:
        return self.gpu.hbm_bw_GBps * 1e9 * self.params.hbm_efficiency

    @property
    def weight_Bps(self) -> float:
        """The rate GEMMs read their weights: a matrix-vector product's where the part gives it
        (``weight_stream_GBps``: a CPU streams weights through its cores slower than it
        copies), else the HBM bandwidth."""
        if self.gpu.weight_stream_GBps:
            return self.gpu.weight_stream_GBps * 1e9
        return self.hbm_Bps

    @property
    def launch_s(self) -> float:
        """Cost of one kernel: the launch gap on a GPU, the eager op's host time where the host
        is the device (a CPU runs each op's dispatch before its work)."""
        if self.gpu.host_is_device:
            if self.gpu.host_op_us is not None:  # measured on this host (calibrate --local)
                return self.gpu.host_op_us * 1e-6
            return self.params.host_cpu_op_s
        return self.params.kernel_overhead_s


@dataclass(frozen=True)
class Work:
    """One engine step on one data-parallel rank: ``prefill_tokens`` new prompt tokens whose
    queries see ``prefill_keys`` keys each on average (a causal prompt of L: L / 2 executed, the
    kernel's call length ``prefill_len``), and ``decode_seqs`` sequences each adding one token
    over a cached context of ``decode_ctx`` tokens."""

    prefill_tokens: float = 0.0
    prefill_keys: float = 0.0
    prefill_len: float = 1.0
    decode_seqs: float = 0.0
    decode_ctx: float = 0.0

    @property
    def tokens(self) -> float:
        return self.prefill_tokens + self.decode_seqs


def _padded(e: Engine, m: float) -> float:
    """Rows the tensor cores compute for ``m`` rows: whole 64-row tiles on a GPU; a CPU host
    (no tensor-core tiles) computes m."""
    if e.gpu.host_is_device:
        return m
    return math.ceil(m / GEMM_M_TILE) * GEMM_M_TILE


def expert_rows(e: Engine, rows: float) -> float:
    """Rows one expert's GEMM computes for ``rows`` routed copies in a fused-MoE grouped GEMM:
    the smallest of MOE_M_TILES that holds them (whole 64-row tiles beyond), on a GPU; a CPU
    host computes the rows."""
    if e.gpu.host_is_device:
        return rows
    tile = next((t for t in MOE_M_TILES if rows <= t), GEMM_M_TILE)
    return math.ceil(rows / tile) * tile


def gemm_s(e: Engine, m: float, k: float, n: float, weight_share: float = 1.0) -> float:
    """(m x k) @ (k x n) with k x n weights, of which ``weight_share`` are read this step (the
    active experts'): the slower of compute at the part's efficiency for this size and the
    bytes of weights (at the weight-stream rate) and activations at HBM bandwidth; their sum on
    a CPU host."""
    if m <= 0:
        return 0.0
    flops = 2.0 * _padded(e, m) * k * n
    peak = e.gpu.sustained_peak_tflops(e.precision)
    eff = gemm_efficiency(e.gpu, e.precision, flops / 1e9, e.params, e.calibration, k, peak)
    compute = flops / (peak * 1e12 * eff)
    weights = k * n * weight_share * e.plan.weight_bytes / e.weight_Bps
    moved = weights + (m * k + m * n) * e.act_bytes / e.hbm_Bps
    if e.gpu.host_is_device:
        # one CPU core issues both the loads that stream the weights and the FMAs, so the two
        # add (a GPU's copy engines and SMs overlap them: the slower sets the time)
        return compute + moved
    return max(compute, moved)


def _attention_heads(e: Engine) -> float:
    return e.model.num_attention_heads / e.plan.tp


def _attn_efficiency(e: Engine, keys: float) -> float:
    best = e.gpu.attention_efficiency("flash")
    fa2 = e.gpu.attention_efficiency("flash2")
    fallback = e.params.attention_efficiency
    best = (best[0] or fallback, best[1] or fallback)
    fa2 = (fa2[0] or best[0], fa2[1] or best[1])
    halves = (e.gpu.attention_half_fwd_tokens, e.gpu.attention_half_bwd_tokens)
    fwd, _ = kernel_efficiency("flash", best, fa2, max(keys, 1.0), e.gpu.attention_tokens, halves)
    d = mla_head_dims(e.model)[0] if e.model.is_mla else e.model.kv_channels
    return min(1.0, fwd * head_dim_factor("flash", d)[0])


def attention_prefill_s(e: Engine, w: Work) -> float:
    """One layer's attention over the step's prompt tokens: executed FLOPs (the causal half the
    kernel computes) at the fused kernel's efficiency for calls of the prompt's length."""
    if w.prefill_tokens <= 0:
        return 0.0
    if e.model.is_mla:
        dqk, dv = mla_head_dims(e.model)
        per_key = 2.0 * (dqk + dv)
    else:
        per_key = 4.0 * e.model.kv_channels
    keys = w.prefill_keys
    if e.model.attention_window is not None and e.model.windowed_layers:
        windowed = e.model.windowed_layers / e.model.num_layers
        keys = keys * (1 - windowed) + min(keys, e.model.attention_window) * windowed
    flops = w.prefill_tokens * keys * per_key * _attention_heads(e)
    peak = e.gpu.sustained_peak_tflops("bf16")
    return flops / (peak * 1e12 * _attn_efficiency(e, w.prefill_len))


def _kv_reads_per_head(e: Engine) -> float:
    """How many times a decode step reads each cached KV head: once with a grouped-query kernel;
    once per query head of its group with a kernel that gives every query head its own block
    (TensorRT-LLM's masked MHA before XQA: data/engines.toml)."""
    if e.plan.software.gqa_grouped_decode or e.model.is_mla:
        return 1.0
    return max(1.0, _attention_heads(e) / kv_heads_per_gpu(e.model, e.plan.tp))


def attention_decode_s(e: Engine, w: Work) -> float:
    """One layer's attention of the step's decoding sequences over their cached contexts: the
    KV bytes at HBM bandwidth (FlashDecoding, FlashInfer and FlashMLA kernels are bound there
    at serving batch sizes), or the FLOPs where they take longer (MLA's absorbed attention,
    whose 128 heads share one latent, reaches the compute roof first). Where the part gives
    ``decode_attention_GBps`` (a CPU host's kernel, measured), the K and V bytes of every query
    head at that rate."""
    if w.decode_seqs <= 0:
        return 0.0
    ctx = w.decode_ctx
    if e.model.attention_window is not None and e.model.windowed_layers:
        windowed = e.model.windowed_layers / e.model.num_layers
        ctx = ctx * (1 - windowed) + min(ctx, e.model.attention_window) * windowed
    rate = e.gpu.decode_attention_GBps
    if rate is not None and not e.model.is_mla:
        # a host's measured kernel (calibrate --local): K and V read once per query head
        per_head = 2 * e.model.kv_channels * e.plan.kv_bytes
        return w.decode_seqs * ctx * _attention_heads(e) * per_head / (rate * 1e9)
    elems = kv_elems_per_token_layer(e.model, e.plan.tp)
    traffic = w.decode_seqs * ctx * elems * e.plan.kv_bytes * _kv_reads_per_head(e)
    if e.model.is_mla:
        assert e.model.kv_lora_rank is not None and e.model.qk_rope_head_dim is not None
        per_key = 2.0 * (2 * e.model.kv_lora_rank + e.model.qk_rope_head_dim)
    else:
        per_key = 4.0 * e.model.kv_channels
    flops = w.decode_seqs * ctx * per_key * _attention_heads(e)
    peak = e.gpu.sustained_peak_tflops("bf16")
    compute = flops / (peak * 1e12 * _attn_efficiency(e, ctx))
    return max(traffic / e.hbm_Bps, compute)


def attention_gemms_s(e: Engine, m: float) -> float:
    """The attention projections of one layer for ``m`` tokens: MLA's down projections
    replicated on every tp rank, the rest split over tp; GQA's QKV and output split over tp."""
    tp = e.plan.tp
    if e.model.is_mla:
        total = 0.0
        for _, n_in, n_out, split in mla_gemms(e.model):
            if split == "rep":
                total += gemm_s(e, m, n_in, n_out)
            elif split == "col":
                total += gemm_s(e, m, n_in, n_out / tp)
            else:
                total += gemm_s(e, m, n_in / tp, n_out)
        return total
    h, d = e.model.hidden_size, e.model.kv_channels
    q = e.model.num_attention_heads * d
    kv = 2 * e.model.kv_heads * d
    return gemm_s(e, m, h, (q + kv) / tp) + gemm_s(e, m, q / tp, h)


def ffn_s(e: Engine, m: float, ffn: float, split: float) -> float:
    """An FFN of width ``ffn`` split ``split`` ways, for ``m`` tokens (gate and up fused)."""
    h = e.model.hidden_size
    width_in = 2 * ffn if e.model.ffn_activation == "swiglu" else ffn
    return gemm_s(e, m, h, width_in / split) + gemm_s(e, m, ffn / split, h)


def experts_touched(num_experts: int, top_k: int, tokens: float) -> float:
    """Expected share of an MoE layer's experts that ``tokens`` route to (uniform routing):
    1 - (1 - k / E) ** tokens."""
    if tokens <= 0:
        return 0.0
    return 1.0 - (1.0 - top_k / num_experts) ** tokens


def busiest_expert_share(e: Engine, tokens_per_dp: float) -> float:
    """The busiest expert GPU's routed copies over the mean for a step of ``tokens_per_dp`` on
    each data-parallel rank: the plan's ``moe_imbalance`` (a run's published load) or, where
    larger, the floor that chance alone sets with balanced experts (routing.py), since a
    published max / mean already contains the chance part."""
    p = e.plan
    if p.ep <= 1:
        return p.moe_imbalance
    floor = routing_imbalance_floor(e.model, p.ep, tokens_per_dp * p.dp)
    return max(p.moe_imbalance, floor)


def routed_experts_s(e: Engine, tokens_per_dp: float) -> float:
    """The routed experts of one MoE layer on one GPU. The stage's tp x dp GPUs hold every
    expert once (ep groups of etp); the tokens of all dp ranks reach them, top_k copies each.
    Weights are read for the experts the step touches; FLOPs are the GPU's share of the
    copies; the busiest GPU takes ``busiest_expert_share`` times the mean and sets the step."""
    m, p = e.model, e.plan
    group_tokens = tokens_per_dp * p.dp
    expert = mlp_params(m, m.expert_ffn_hidden_size)
    touched = experts_touched(m.num_experts, m.moe_top_k, group_tokens)
    local = m.num_experts / p.ep
    # routed token copies this GPU's experts take (the busiest GPU's)
    copies = group_tokens * m.moe_top_k / p.ep * busiest_expert_share(e, tokens_per_dp)
    if copies <= 0:
        return 0.0
    per_expert = copies / max(local * touched, 1e-9)
    active = max(local * touched, 1e-9)
    # each expert's rows in whole tiles of the size the grouped kernel picks for them
    flops = 2.0 * expert_rows(e, per_expert) * active * expert / p.etp
    peak = e.gpu.sustained_peak_tflops(e.precision)
    k = m.hidden_size
    # one grouped launch computes every active expert: its efficiency is the launch's size's
    gflop = 2.0 * copies * expert / p.etp / 1e9
    eff = gemm_efficiency(e.gpu, e.precision, gflop, e.params, e.calibration, k, peak)
    compute = flops / (peak * 1e12 * eff)
    weights = local * touched * expert / p.etp * p.weight_bytes
    acts = copies * m.hidden_size * 2 * e.act_bytes
    return max(compute, weights / e.weight_Bps + acts / e.hbm_Bps)


def moe_copy_moves_s(e: Engine, tokens: float) -> float:
    """One MoE layer's data movement of the routed copies at HBM bandwidth: the top_k copies
    of each token written into expert order and read by the grouped GEMM, the outputs read back
    and summed with their weights (the permute / un-permute kernels of vLLM's fused MoE, SGLang's
    and DeepEP's layouts): four hidden-sized reads or writes per copy, on the busiest GPU."""
    m, p = e.model, e.plan
    copies = tokens * p.dp * m.moe_top_k / p.ep * busiest_expert_share(e, tokens)
    return 4.0 * copies * m.hidden_size * e.act_bytes / p.etp / e.hbm_Bps


def elementwise_s(e: Engine, tokens: float) -> float:
    """Norms, residual adds, RoPE and the activation of one layer at HBM bandwidth: about 12
    hidden-sized reads or writes per token and three of the local FFN width."""
    h = e.model.hidden_size
    ffn = e.model.expert_ffn_hidden_size if e.model.is_moe else e.model.ffn_hidden_size
    return tokens * (12 * h + 3 * ffn / e.plan.tp) * e.act_bytes / e.hbm_Bps


@dataclass(frozen=True)
class StageCompute:
    """Compute of one stage's layers for one step on one GPU, by kernel class, seconds."""

    gemm: float
    moe: float
    attention_prefill: float
    attention_decode: float
    elementwise: float
    logits: float
    launches: float

    @property
    def total(self) -> float:
        return (
            self.gemm
            + self.moe
            + self.attention_prefill
            + self.attention_decode
            + self.elementwise
            + self.logits
            + self.launches
        )


def stage_kernels(e: Engine, w: Work, last_stage: bool = True) -> int:
    """Kernels one stage launches in a step of ``w``: the fused kernels a layer counts on a GPU
    (KERNELS_PER_LAYER, KERNELS_PER_MOE_LAYER); where the host is the device, the eager ops it
    dispatches, counted."""
    dense, moe = stage_layer_counts(e.model, e.plan.pp)
    if e.gpu.host_is_device:
        kind = "prefill" if w.prefill_tokens > 0 else "decode"
        outside = EAGER_OPS_OUTSIDE if last_stage else 0
        return (dense + moe) * EAGER_OPS_PER_LAYER[kind] + outside
    return dense * KERNELS_PER_LAYER + moe * KERNELS_PER_MOE_LAYER


def host_issue_s(e: Engine, w: Work, last_stage: bool = True) -> float:
    """The host's time to issue one stage's layers of a step where no CUDA graph replays them
    and the engine runs its model as PyTorch ops from Python (software.python_host: vLLM with
    enforce_eager, as verl's rollout ran by default until August 2025): a dense layer's counted
    kernels at ModelParams.host_eager_op_s, the published host cost of one eager op on a CUDA
    tensor, and an MoE layer at ModelParams.host_eager_moe_layer_s, the published eager MoE
    decode steps' host time a layer (its Python-launched routing and Triton GEMMs cost the host
    about five times its counted kernels). The GPU runs a kernel only once it is issued, so a
    step is no shorter than this (0: graphs replay the step, or a C++ runtime enqueues it at
    the launch gap already priced)."""
    sw = e.plan.software
    if sw.cuda_graphs or not sw.python_host or e.gpu.host_is_device:
        return 0.0
    dense, moe = stage_layer_counts(e.model, e.plan.pp)
    p = e.params
    return dense * KERNELS_PER_LAYER * p.host_eager_op_s + moe * p.host_eager_moe_layer_s


def stage_compute(e: Engine, w: Work, last_stage: bool = True) -> StageCompute:
    """One step of ``w`` through the largest stage's layers (and the output layer for the
    sequences that sample a token, on the last stage)."""
    m, tp = e.model, e.plan.tp
    dense, moe = stage_layer_counts(m, e.plan.pp)
    t = w.tokens
    attn_g = attention_gemms_s(e, t)
    gemm = dense * (attn_g + ffn_s(e, t, m.ffn_hidden_size, tp)) + moe * attn_g
    moe_s = 0.0
    if moe:
        shared = m.num_shared_experts * m.expert_ffn_hidden_size
        router = gemm_s(e, t, m.hidden_size, m.num_experts)
        moe_s = moe * (routed_experts_s(e, t) + router + (ffn_s(e, t, shared, tp) if shared else 0))
    layers = dense + moe
    if moe:  # the routed copies' permute into expert order and the weighted un-permute
        moe_s += moe * moe_copy_moves_s(e, t)
    sampled = w.decode_seqs + (w.prefill_tokens / max(w.prefill_len, 1.0))
    logits = gemm_s(e, sampled, m.hidden_size, m.vocab_size / tp) if last_stage else 0.0
    kernels = stage_kernels(e, w, last_stage)
    return StageCompute(
        gemm=gemm,
        moe=moe_s,
        attention_prefill=layers * attention_prefill_s(e, w),
        attention_decode=layers * attention_decode_s(e, w),
        elementwise=layers * elementwise_s(e, t),
        logits=logits,
        launches=kernels * e.launch_s,
    )
