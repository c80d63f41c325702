"""The vision encoder and projector: parameters, FLOPs, time and memory of one image.

An image becomes P encoder tokens (patches, and class tokens per tile) and T language-model
tokens (P / merge^2 without the class tokens). Each encoder layer is a pre-norm ViT block:
QKV and output projections (4 h^2 weights), the MLP (2 h f, or 3 h f gated) and attention
*without a causal mask*: every query sees every key of its call, so the attention core is
counted and executed in full (no causal halving), 4 h FLOPs per query-key pair forward. What
one call spans decides the pairs: a tile alone (LLaVA, InternVL), a whole image across its tiles
(Llama 3.2 Vision), or a window of W patches (Qwen2.5-VL's windowed layers, all but
``full_attention_layers``). The projector is a 2-layer MLP (or one linear layer) on the merged
tokens. Backward is twice the forward's GEMMs and 2.5 times its attention (FlashAttention's
backward recomputes the scores); a frozen encoder runs its forward only.

Time per image is linear in its patches and pairs (``EncoderRates``): the GEMMs' and element-wise
seconds per patch, read at the micro-batch's mean patch count from the step model's GEMM curve
(perf/step/gemm.py), and the attention seconds per pair at the fused kernel's efficiency for
the call's length (perf/step/attention_kernels.py), so the distribution of images maps to a
distribution of seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from aihpc.perf.step.attention_kernels import head_dim_factor, kernel_efficiency
from aihpc.perf.step.comm import collective_time_s
from aihpc.perf.step.gemm import gemm_bwd_s, gemm_time_s, stream_time_s
from aihpc.perf.step.params import ModelParams
from aihpc.runspec.cluster import ClusterSpec
from aihpc.runspec.training import TrainingSpec
from aihpc.runspec.vision import VisionSpec

__all__ = [
    "EncoderRates",
    "ImageWork",
    "encoder_params",
    "encoder_rates",
    "image_work",
    "projector_params",
]

# Element-wise traffic of one ViT layer per token, in 16-bit values of width h (two norms'
# input and output, two residual adds, bias/activation of the MLP counted in f): forward; the
# backward moves twice as much.
_STREAM_H = 12
_STREAM_F = 3


def _ffn_in(v: VisionSpec) -> int:
    return 2 * v.ffn_hidden_size if v.ffn_activation == "swiglu" else v.ffn_hidden_size


def layer_params(v: VisionSpec) -> int:
    h = v.hidden_size
    return 4 * h * h + h * _ffn_in(v) + v.ffn_hidden_size * h + 2 * h


def projector_in(v: VisionSpec) -> int:
    return v.hidden_size * v.merge * v.merge * v.feature_layers


def projector_params(v: VisionSpec, llm_hidden: int) -> int:
    """The projector's weights: in -> projector_hidden -> LLM width, or one linear layer."""
    d = projector_in(v)
    if v.projector_hidden:
        return d * v.projector_hidden + v.projector_hidden * llm_hidden
    return d * llm_hidden


def encoder_params(v: VisionSpec) -> int:
    """The encoder's weights: its layers and the patch embedding (3 channels x p^2 x h)."""
    return v.num_layers * layer_params(v) + 3 * v.patch_size**2 * v.hidden_size


@dataclass(frozen=True)
class ImageWork:
    """One image's work: encoder tokens, query-key pairs summed over the layers, the
    language-model tokens it becomes, and its longest attention call (keys)."""

    patches: float
    pairs: float
    lm_tokens: float
    call_keys: float

    def flops_fwd(self, v: VisionSpec, llm_hidden: int) -> float:
        """Forward FLOPs of the encoder and projector on this image."""
        gemm = 2.0 * self.patches * (layer_params(v) - 2 * v.hidden_size) * v.num_layers
        attn = 4.0 * v.hidden_size * self.pairs
        proj = 2.0 * self.lm_tokens * projector_params(v, llm_hidden)
        return gemm + attn + proj


def image_work(v: VisionSpec, image_tokens: float) -> ImageWork:
    """The work of an image that becomes ``image_tokens`` language-model tokens."""
    patches, tiles = v.encoder_patches(image_tokens)
    if v.resolution == "tiles":
        lm = tiles * v.tokens_per_tile
        call = patches if v.attention_scope == "image" else v.patches_per_tile
    else:
        lm = image_tokens
        call = patches
    full = patches * call  # pairs of one full layer: every query over its call's keys
    if v.window_patches:
        windowed = v.num_layers - v.full_attention_layers
        pairs = v.full_attention_layers * full + windowed * patches * min(v.window_patches, call)
    else:
        pairs = v.num_layers * full
    return ImageWork(float(patches), float(pairs), float(lm), float(call))


@dataclass(frozen=True)
class EncoderRates:
    """Seconds on one GPU of an encoder split ``tp`` ways: per encoder token (GEMMs and
    element-wise work), per query-key pair (fused attention), per language-model token (the
    projector), forward and backward; and the TP all-reduces per encoder token."""

    tp: int
    patch_fwd: float
    patch_bwd: float
    pair_fwd: float
    pair_bwd: float
    lm_fwd: float
    lm_bwd: float
    comm_patch: float  # forward's TP all-reduces per token (the backward's as many)
    recompute: bool = False  # a trained encoder runs its forward again in the backward

    def image_s(self, w: ImageWork, encoder_trained: bool, projector_trained: bool) -> float:
        """Seconds of one image: the forward, and the backward of what is trained (with the
        forward again under recompute). A frozen encoder under a trained projector runs no
        backward (nothing before it learns)."""
        fwd = w.patches * (self.patch_fwd + self.comm_patch) + w.pairs * self.pair_fwd
        enc = fwd
        if encoder_trained:
            enc += w.patches * (self.patch_bwd + self.comm_patch) + w.pairs * self.pair_bwd
            enc += fwd if self.recompute else 0.0
        proj = w.lm_tokens * (self.lm_fwd + (self.lm_bwd if projector_trained else 0.0))
        return enc + proj


def _gemm(v: VisionSpec, cluster: ClusterSpec, training: TrainingSpec, params: ModelParams):  # type: ignore[no-untyped-def]
    gpu, cal = cluster.gpu, cluster.calibration
    prec = "bf16" if training.precision == "fp8" else training.precision  # ViTs stay 16-bit

    def gemm(m: float, n: float, k: float) -> float:
        return gemm_time_s(m, n, k, gpu, prec, params, cal)

    return gemm, prec


def encoder_rates(
    v: VisionSpec,
    llm_hidden: int,
    cluster: ClusterSpec,
    training: TrainingSpec,
    params: ModelParams,
    tp: int,
    patches: float,
    call_keys: float,
    lm_tokens: float,
    recompute: bool = False,
) -> EncoderRates:
    """The rates of an encoder split ``tp`` ways whose micro-batch holds ``patches`` encoder
    tokens (the mean), attention calls of ``call_keys`` keys and ``lm_tokens`` projector
    tokens."""
    gemm, prec = _gemm(v, cluster, training, params)
    h, m = v.hidden_size, max(1.0, patches)
    shapes = [(m, 3 * h / tp, h), (m, h, h / tp), (m, _ffn_in(v) / tp, h)]
    shapes.append((m, h, v.ffn_hidden_size / tp))
    fwd = sum(gemm(*s) for s in shapes) * v.num_layers
    bwd = sum(gemm_bwd_s(gemm, *s) for s in shapes) * v.num_layers
    stream = 2.0 * (_STREAM_H * h + _STREAM_F * v.ffn_hidden_size / tp) * m * v.num_layers
    fwd += stream_time_s(stream, cluster.gpu, params, kernels=6 * v.num_layers)
    bwd += stream_time_s(2 * stream, cluster.gpu, params, kernels=10 * v.num_layers)
    eff_f, eff_b = _attention_eff(v, cluster, training, params, call_keys)
    peak = cluster.gpu.sustained_peak_tflops(prec) * 1e12
    pair = 4.0 * h / tp / peak
    lm = max(1.0, lm_tokens)
    d = projector_in(v)
    if v.projector_hidden:
        pshapes = [(lm, v.projector_hidden, d), (lm, llm_hidden, v.projector_hidden)]
    else:
        pshapes = [(lm, llm_hidden, d)]
    p_fwd = sum(gemm(*s) for s in pshapes)
    p_bwd = sum(gemm_bwd_s(gemm, *s) for s in pshapes)
    comm = 0.0
    if tp > 1:  # two all-reduces of the layer's output per layer, forward (and backward)
        one = collective_time_s(cluster, "all_reduce", 2.0 * m * h, tp, 1, params)
        comm = 2 * v.num_layers * one / m
    return EncoderRates(
        tp=tp,
        patch_fwd=fwd / m,
        patch_bwd=bwd / m,
        pair_fwd=pair / eff_f,
        pair_bwd=2.5 * pair / eff_b,
        lm_fwd=p_fwd / lm,
        lm_bwd=p_bwd / lm,
        comm_patch=comm,
        recompute=recompute,
    )


def _attention_eff(
    v: VisionSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    params: ModelParams,
    call_keys: float,
) -> tuple[float, float]:
    """(forward, backward) efficiency of the fused kernel on calls of ``call_keys`` keys at the
    encoder's head dimension (the step model's curve; no causal mask, so no half-masked tiles:
    the curve's short-call loss is an upper bound here)."""
    gpu = cluster.gpu
    best = gpu.attention_efficiency("flash")
    fa2 = gpu.attention_efficiency("flash2")
    best = (best[0] or params.attention_efficiency, best[1] or params.attention_efficiency)
    fa2 = (fa2[0] or best[0], fa2[1] or best[1])
    halves = (gpu.attention_half_fwd_tokens, gpu.attention_half_bwd_tokens)
    kernel = training.attention if training.attention != "unfused" else "flash2"
    f, b = kernel_efficiency(kernel, best, fa2, max(1.0, call_keys), gpu.attention_tokens, halves)
    hf, hb = head_dim_factor(kernel, v.hidden_size / v.num_attention_heads)
    return float(f) * hf, float(b) * hb


def encoder_memory_bytes(
    v: VisionSpec,
    llm_hidden: int,
    tp: int,
    shards: int,
    zero_stage: int,
    encoder_trained: bool,
    projector_trained: bool,
) -> float:
    """Weights, gradients and optimizer state of the encoder and projector on one GPU that
    holds a 1/tp share: 2 bytes a weight (16-bit), and for what is trained 4 (fp32 gradient) +
    12 (fp32 master, Adam m and v), sharded over ``shards`` data-parallel ranks as the plan's
    ZeRO stage shards the language model's."""

    def state(n: float, trained: bool) -> float:
        if not trained:
            return 2.0 * n / (shards if zero_stage >= 3 else 1)
        w = 2.0 / (shards if zero_stage >= 3 else 1)
        g = 4.0 / (shards if zero_stage >= 2 else 1)
        o = 12.0 / (shards if zero_stage >= 1 else 1)
        return n * (w + g + o)

    enc = state(encoder_params(v) / tp, encoder_trained)
    return enc + state(projector_params(v, llm_hidden) / tp, projector_trained)


def encoder_activation_bytes(v: VisionSpec, patches: float, tp: int, recompute: str) -> float:
    """Activations a trained encoder keeps for its backward, for ``patches`` tokens: per layer
    and token (10 + 24 / t) h bytes with a fused attention kernel (Korthikanti et al. 2022,
    Table 2 without the softmax path), 2 h under full recompute (the layer inputs)."""
    per = 2.0 * v.hidden_size if recompute == "full" else (10 + 24 / tp) * v.hidden_size
    return per * patches * v.num_layers
