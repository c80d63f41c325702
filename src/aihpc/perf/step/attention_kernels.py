"""Fused attention kernels by implementation and by the sequence each call sees.

A fused attention kernel's fraction of the 16-bit peak depends on which kernel ran and on how
long the key sequence of one call is. The GPU catalog gives, per part, the long-sequence figure
of its best kernel (``attention_*``: FlashAttention-3 / cuDNN on Hopper and newer,
FlashAttention-2 on Ampere) and of FlashAttention-2 where it is not the best (``flash2_*``).
The kernels older or more general than FlashAttention-2 are priced as published fractions of
it, on the same part; every kernel's figure then falls at short sequences on a measured curve.

Every function takes floats or numpy arrays (element-wise), so the scalar estimate and the
search's array path price a plan with the same arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np

__all__ = [
    "FUSED_KERNELS",
    "KERNELS",
    "REFERENCE_TOKENS",
    "KernelClass",
    "head_dim_factor",
    "kernel_efficiency",
    "kernel_tokens",
    "length_factor",
    "window_keys",
]

Num = TypeVar("Num", float, np.ndarray)


@dataclass(frozen=True)
class KernelClass:
    """How one attention implementation is priced.

    base: whose catalog figure it scales, "best" (``attention_*``) or "flash2" (``flash2_*``);
    fwd_ratio, bwd_ratio: its speed as a fraction of that kernel's on the same part;
    half_fwd_tokens, half_bwd_tokens: the key length at which the kernel reaches half of its
    long-sequence efficiency (the curve ``s / (s + s_half)``, see ``length_factor``).
    """

    base: str
    fwd_ratio: float
    bwd_ratio: float
    half_fwd_tokens: float
    half_bwd_tokens: float


# The papers benchmark the kernels up to 16K tokens, where they have levelled off; the catalog's
# figures are read there (Dao 2023, figs. 4-7; Shah et al. 2024, figs. 5-6: 512 to 16K tokens).
REFERENCE_TOKENS = 16384.0

# Half-efficiency key lengths, from the causal head-dim-128 sweep on an H200 (torch 2.11,
# benchmarks/results/kernel_efficiency_h200.md: 2K to 64K tokens, 32K tokens per call), fitted
# to 1 / efficiency = (1 + s_half / s) / efficiency_long by least squares (every point within
# 6%). A query tile's prologue and epilogue (load Q, rescale and write O, or the dQ atomics of
# the backward) and the half-masked diagonal tile are paid once per tile, whatever the number of
# key tiles its loop runs, so their share falls as 1 / s.
# SDPA flash backend (FlashAttention-2): forward 356 TF/s long, s_half 454; backward 325, 1,081.
_FA2_HALF = (454.0, 1081.0)
# SDPA cuDNN backend (the class of `flash` on Hopper): forward 645 long, s_half 221; backward
# 540, 930. FlashAttention-3 was not measured; it is priced on cuDNN's curve.
_CUDNN_HALF = (221.0, 930.0)
# SDPA memory-efficient backend (xformers' CUTLASS kernels): forward 183, s_half 383; backward
# 138, 628.
_XFORMERS_HALF = (383.0, 628.0)

KERNELS: dict[str, KernelClass] = {
    # The best fused kernel of the part (FlashAttention-3, cuDNN, Transformer Engine's fused
    # attention on Hopper and newer; FlashAttention-2 on Ampere).
    "flash": KernelClass("best", 1.0, 1.0, *_CUDNN_HALF),
    # FlashAttention-2 (the flash-attn package 2.x, PyTorch SDPA's flash backend).
    "flash2": KernelClass("flash2", 1.0, 1.0, *_FA2_HALF),
    # FlexAttention (torch.compile-generated Triton): "FlexAttention achieves 90% of
    # FlashAttention2's performance in the forward pass and 85% in the backward pass" (PyTorch
    # blog, 2024-08-07, causal attention on A100).
    "flex": KernelClass("flash2", 0.90, 0.85, *_FA2_HALF),
    # FlashAttention in Triton (flash-attn's flash_attn_triton.py, the pre-MLIR Triton kernel
    # llm-foundry's attn_impl "triton" copies): "FlashAttention-2 is around 1.3-1.5x faster than
    # FlashAttention in Triton in the forward pass and around 2x faster in the backward pass"
    # (Dao 2023, sec. 4.1; 1.4x taken for the forward).
    "triton": KernelClass("flash2", 1 / 1.4, 0.5, *_FA2_HALF),
    # FlashAttention (v1, 2022) and xformers' memory-efficient CUTLASS kernels (2022-2023):
    # "FlashAttention-2 is around 2x faster than FlashAttention and FlashAttention in xformers
    # (the 'cutlass' implementation)" (Dao 2023, sec. 4.1, forward + backward); the same
    # CUTLASS kernels as SDPA's memory-efficient backend measured 0.52 and 0.42 of
    # FlashAttention-2 on the H200 (forward, backward, long sequences).
    "flash1": KernelClass("flash2", 0.5, 0.5, *_XFORMERS_HALF),
}
FUSED_KERNELS = tuple(KERNELS)


# Head dimension: the catalog's figures are head dim 128's. At head dim 64 a kernel does half the
# matmul work per score it computes, so the softmax and the per-tile costs weigh more. The
# FlashAttention-3 paper's H100 sweeps (Shah et al. 2024, figs. 5 and 6: BF16, 512 to 16K tokens)
# give head dim 64 over head dim 128, averaged over 4K, 8K and 16K tokens: FlashAttention-3 0.76
# forward (476/638, 496/646, 497/648 TF/s) and 0.84 backward (453/542, 472/559, 474/561);
# FlashAttention-2 0.87 (321/368, 322/370, 324/370) and 0.90 (279/310, 287/318, 291/322).
# (cuDNN in the same figures: 0.68 and 0.84.) The best-kernel class takes FlashAttention-3's, as
# the Hopper catalog figures do; the kernels priced from FlashAttention-2 take its.
_HEAD_DIM_64 = {"best": (0.76, 0.84), "flash2": (0.87, 0.90)}


def head_dim_factor(kernel: str, head_dim: float) -> tuple[float, float]:
    """(forward, backward) efficiency of ``kernel`` at ``head_dim`` over head dim 128's: the
    published head-dim-64 ratios, linear in between, 1 from 128 up (larger heads were not
    measured backward), and head dim 64's below it (smaller heads are slower still, not
    measured)."""
    f64, b64 = _HEAD_DIM_64[KERNELS[kernel].base]
    t = min(1.0, max(0.0, (head_dim - 64.0) / 64.0))
    return f64 + t * (1.0 - f64), b64 + t * (1.0 - b64)


def length_factor(
    kv_tokens: Num, half_tokens: float, reference_tokens: float = REFERENCE_TOKENS
) -> Num:
    """A kernel's efficiency at key length ``kv_tokens`` over its efficiency at the length its
    figure was measured at (``reference_tokens``, the catalog's REFERENCE_TOKENS by default):
    (s / (s + s_half)) / (s_ref / (s_ref + s_half)). 1 at the reference length, below it for
    shorter calls, a little above it (at most 1 + s_half / s_ref) for longer ones."""
    ref = reference_tokens
    return kv_tokens * (ref + half_tokens) / (ref * (kv_tokens + half_tokens))


def kernel_tokens(seq_length: Num, cp: Num) -> Num:
    """Key length of one attention call: the whole sequence, or under context parallelism the
    rank's share of it, the size of the blocks the ring (or the gathered K/V) is processed in."""
    return seq_length / cp


def window_keys(seq_length: Num, window: float) -> Num:
    """Keys per query a causal sliding-window kernel computes, averaged over the sequence: the
    first ``window`` queries see 1, 2, ..., window keys, the rest ``window`` each; a window as
    long as the sequence is plain causal attention (s / 2 on average, as the full layers are
    priced)."""
    s = np.asarray(seq_length, dtype=float)
    w = np.minimum(float(window), s)
    band = (w * (w + 1) / 2 + (s - w) * w) / s
    out = np.where(w >= s, s / 2, band)
    return out if out.ndim else float(out)  # type: ignore[return-value]


def kernel_efficiency(
    kernel: str,
    best: tuple[float, float],
    flash2: tuple[float, float],
    kv_tokens: Num,
    reference_tokens: float | None = None,
    halves: tuple[float | None, float | None] = (None, None),
) -> tuple[Num, Num]:
    """(forward, backward) fraction of the 16-bit peak of ``kernel`` on a part whose best
    kernel reaches ``best`` and FlashAttention-2 ``flash2`` (forward, backward) on calls of
    ``reference_tokens`` keys (None: REFERENCE_TOKENS, the catalog's long calls), for calls over
    ``kv_tokens`` keys. ``halves``: the part's own half-efficiency key lengths (forward,
    backward) where measured (``aihpc calibrate --local``), else the kernel class's."""
    k = KERNELS[kernel]
    eff_f, eff_b = best if k.base == "best" else flash2
    ref = REFERENCE_TOKENS if reference_tokens is None else reference_tokens
    half_f = k.half_fwd_tokens if halves[0] is None else halves[0]
    half_b = k.half_bwd_tokens if halves[1] is None else halves[1]
    fwd = eff_f * k.fwd_ratio * length_factor(kv_tokens, half_f, ref)
    bwd = eff_b * k.bwd_ratio * length_factor(kv_tokens, half_b, ref)
    return fwd, bwd
