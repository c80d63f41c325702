"""PyTorch's deterministic mode (``training.deterministic``): every fresh allocation filled.

Megatron's ``--deterministic-mode`` calls ``torch.use_deterministic_algorithms(True)``
(``megatron/training/determinism.py``, Megatron-LM at 93ebf8d) and leaves
``torch.utils.deterministic.fill_uninitialized_memory`` at its default, true: PyTorch's own
``empty`` kernels (``aten/src/ATen/native/cuda/TensorFactories.cu``, ``empty_cuda`` and
``empty_strided_cuda``) then write NaN into every tensor they return ("filling uninitialized
memory is detrimental to performance", the PyTorch documentation of that flag). Structured
ATen kernels allocate their outputs below that function and are not filled; Transformer
Engine's extension allocates every output it returns with ``at::empty``
(``allocateTorchTensor``, ``transformer_engine/pytorch/csrc``), which is. So each tensor a
Transformer Engine layer returns is written twice: once by the fill, once by the kernel.

Counted per token and dense layer, on one rank (column-parallel outputs split ``tp`` ways),
as Megatron-Core's Transformer Engine layer spec builds the layer (``TELayerNormColumnParallel
Linear`` for QKV and FC1, Transformer Engine's fused RoPE applied to the query and the key
apart, ``TEDotProductAttention``, ``TERowParallelLinear`` for the output projection and FC2;
the SwiGLU and the residual adds are Megatron's fused PyTorch functions, structured kernels,
not filled):

- forward: the QKV norm's output (h), QKV (q + 2 kv), the rotated query (q) and key (kv), the
  attention output (q), the projection (h), FC1's norm output (h), FC1 (f, 2f gated), FC2 (h);
- backward (input gradients): FC2's (f), FC1's (h) and its norm's (h), the projection's (q),
  attention's dQ, dK, dV (q + 2 kv), the RoPE's (q + kv: ``fused_rope_backward``'s
  ``at::empty``), QKV's (h) and its norm's (h).

Weight gradients are not counted (Megatron accumulates them in place under its default
gradient-accumulation fusion; a frozen layer has none). Each fill is one memory-bound kernel
writing the tensor at the GPU's bandwidth (``gemm.stream_time_s``). Not counted: the
attention's softmax statistics (fp32, heads per token), the loss and the encoder.

``tests/perf/test_deterministic_fill.py`` checks the counts against this list and the
PyTorch fact the term rests on.
"""

from __future__ import annotations

from aihpc.perf.step.gemm import stream_time_s
from aihpc.perf.step.params import ModelParams
from aihpc.runspec.cluster import GPUSpec
from aihpc.runspec.model import ModelSpec
from aihpc.runspec.training import TrainingSpec

__all__ = ["ACTIVATION_BYTES", "FILLS_BWD", "FILLS_FWD", "fill_elements", "fill_s"]

# bf16 / fp16 activations (under FP8 recipes Transformer Engine's GEMMs return 16-bit too).
ACTIVATION_BYTES = 2
# Filled allocations a layer makes per pass (the list above): the kernels the fill launches.
FILLS_FWD = 9
FILLS_BWD = 9


def fill_elements(model: ModelSpec, tp: int) -> tuple[float, float]:
    """Elements one token's pass through one dense layer allocates through ``aten::empty`` on
    a rank: (forward, backward)."""
    h, f = model.hidden_size, model.ffn_hidden_size
    q = model.num_attention_heads * model.kv_channels
    kv = model.kv_heads * model.kv_channels
    f_in = 2 * f if model.ffn_activation == "swiglu" else f
    rope = (q + kv) / tp  # the rotated query and key, or their gradients
    fwd = h + (q + 2 * kv) / tp + rope + q / tp + h + h + f_in / tp + h
    bwd = f / tp + h + h + q / tp + (q + 2 * kv) / tp + rope + h + h
    return fwd, bwd


def fill_s(
    model: ModelSpec,
    tokens: float,
    layers: int,
    tp: int,
    micro_batches: int,
    recompute: bool,
    gpu: GPUSpec,
    training: TrainingSpec,
    params: ModelParams,
) -> float:
    """Seconds a rank spends filling a step's allocations: ``tokens`` through ``layers`` dense
    layers forward (twice under full recompute) and backward, in ``micro_batches`` passes;
    0 unless ``training.deterministic``."""
    if not training.deterministic:
        return 0.0
    fwd, bwd = fill_elements(model, tp)
    passes = 2 if recompute else 1
    num_bytes = tokens * layers * (passes * fwd + bwd) * ACTIVATION_BYTES
    kernels = micro_batches * layers * (passes * FILLS_FWD + FILLS_BWD)
    return float(stream_time_s(num_bytes, gpu, params, kernels=kernels))
