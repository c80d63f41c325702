"""The routed experts' GEMMs of one MoE layer on one GPU, by how the framework runs them
(``training.moe_expert_gemm``), in seconds.

- ``grouped``: one grouped-GEMM kernel per projection covers every local expert (CUTLASS or
  cuBLASLt grouped GEMM, DeepGEMM's grouped kernels, ``torch._grouped_mm``): one launch, each
  expert's product at the efficiency of a GEMM of its own rows.
- ``per_expert``: one cuBLAS GEMM launch per local expert and projection, on a pool of streams,
  each expert's input split off (and under FP8 quantized) on its own, after the per-expert token
  counts have been read on the host. This is Transformer Engine's ``GroupedLinear`` on its
  default path, which Megatron-Core's ``TEGroupedMLP`` (``--moe-grouped-gemm``) calls with the
  token counts as a host list: TE's MoE guide ("Grouped GEMM": "one cuBLAS GEMM per expert is
  launched on a pool of CUDA streams ... reading the token counts is a device-to-host
  synchronization"), ``nvte_multi_tensor_gemm`` in ``common/gemm/cublaslt_gemm.cu`` calling
  ``multi_stream_cublas_gemm`` unless ``NVTE_USE_CUTLASS_GROUPED_GEMM`` is set on Hopper; the
  single cuBLASLt grouped GEMM needs cuBLAS 13.3 or newer. Megatron-Core's ``SequentialMLP``
  (a Python loop of one MLP per expert) pays the same launches.

What ``per_expert`` adds over ``grouped``, per MoE layer and micro-batch forward (the backward's
dgrad and wgrad GEMMs are twice the forward, as for every GEMM of the model): a launch per local
expert and projection instead of one, with FP8 a quantize launch per local expert and projection
(the cast's bytes are priced with the element-wise traffic). The host side of an eager layer
(the counts read on the host, every op issued from Python) is perf/moe_host.py's, priced where
``training.cuda_graphs`` is ``none``.
"""

from __future__ import annotations

from aihpc.perf.params import ModelParams

__all__ = ["expert_gemm_time_s"]


def expert_gemm_time_s(
    one_expert_s: float, local_experts: float, precision: str, params: ModelParams, how: str
) -> float:
    """One projection of every local expert, from ``one_expert_s``: one expert's product priced
    by the GEMM model at its own rows, one launch included (``compute.gemm_time_s``)."""
    launch = params.kernel_overhead_s
    body = local_experts * (one_expert_s - launch)
    if how == "grouped":
        return body + launch
    quantize = local_experts * launch if precision == "fp8" else 0.0
    return body + local_experts * launch + quantize
