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
(the counts read on the host, every op issued from Python) is perf/step/moe_host.py's, priced where
``training.cuda_graphs`` is ``none``.
"""

from __future__ import annotations

from aihpc.perf.step.gemm import gemm_bwd_s, gemm_time_s
from aihpc.perf.step.moe_stack import stack_of
from aihpc.perf.step.params import ModelParams
from aihpc.runspec.calibration import Calibration
from aihpc.runspec.cluster import GPUSpec
from aihpc.runspec.model import ModelSpec
from aihpc.runspec.parallel import ParallelPlan
from aihpc.runspec.training import TrainingSpec

__all__ = ["expert_gemm_time_s", "routed_expert_gemms", "routed_tokens"]


def expert_gemm_time_s(
    one_expert_s: float, local_experts: float, precision: str, params: ModelParams, how: str
) -> float:
    """One projection of every local expert, from ``one_expert_s``: one expert's product priced
    by the GEMM model at its own rows, one launch included (``gemm.gemm_time_s``)."""
    launch = params.kernel_overhead_s
    body = local_experts * (one_expert_s - launch)
    if how == "grouped":
        return body + launch
    quantize = local_experts * launch if precision == "fp8" else 0.0
    return body + local_experts * launch + quantize


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


def routed_expert_gemms(
    model: ModelSpec,
    gpu: GPUSpec,
    plan: ParallelPlan,
    training: TrainingSpec,
    params: ModelParams,
    calibration: Calibration | None,
) -> tuple[float, float, float]:
    """(forward GEMM seconds, backward GEMM seconds, forward element-wise HBM bytes) of one MoE
    layer's router and routed experts on the busiest GPU.

    The E / ep local experts' products are priced at the tokens each actually sees, so their
    size-dependent efficiency is that of a GEMM of tokens-per-expert rows, and every expert's
    weights are read once; they run as one grouped GEMM per projection or one launch per expert
    (``training.moe_expert_gemm``, perf/step/moe_kernels.py). The router is a GEMM of the local
    tokens onto the experts. The backward's weight gradients contract over each expert's
    tokens (``gemm_bwd_s``)."""
    h, ffn = model.hidden_size, model.expert_ffn_hidden_size
    f_in = 2 * ffn if model.ffn_activation == "swiglu" else ffn
    prec = training.precision
    local = model.num_experts / plan.ep
    copies = routed_tokens(model, plan, training)
    per_expert = copies / local

    def local_experts(m: float, n: float, k: float) -> float:  # one product per local expert
        one = gemm_time_s(m, n, k, gpu, prec, params, calibration)
        return expert_gemm_time_s(one, local, prec, params, training.moe_expert_gemm)

    def router(m: float, n: float, k: float) -> float:
        return gemm_time_s(m, n, k, gpu, "bf16", params, calibration)

    tokens = plan.micro_batch_size * model.seq_length / (plan.cp * plan.tp)
    experts = ((per_expert, f_in / plan.etp, h), (per_expert, h, ffn / plan.etp))
    fwd = sum(local_experts(*s) for s in experts) + router(tokens, model.num_experts, h)
    bwd = sum(gemm_bwd_s(local_experts, *s) for s in experts)
    bwd += gemm_bwd_s(router, tokens, model.num_experts, h)
    stack = stack_of(training)
    if stack is not None and stack.einsum_dispatch:
        # DeepSpeed-MoE dispatches and combines with dense einsums over the (tokens, experts,
        # capacity) masks: ecm = sec x sm contracts over the tokens, sm = sec x ecm over the
        # E x C slots (deepspeed/moe/sharded_moe.py); E x C = tokens x k x capacity factor.
        slots = tokens * model.moe_top_k * (model.moe_capacity_factor or 1.0)
        for m, n, kk in ((slots, h, tokens), (tokens, h, slots)):
            fwd += router(m, n, kk)
            bwd += gemm_bwd_s(router, m, n, kk)
    # Bytes: router scores (fp32 logits, softmax / top-k), permute (read the token, write each
    # copy), the expert activation (read f_in, write ffn per copy), unpermute (read each copy
    # and its weight, write the token), all 16-bit.
    act = 2 * (f_in + ffn) / plan.etp
    moved = tokens * model.num_experts * 4 * 3 + 2 * (tokens * h + copies * h) * 2
    moved += copies * act
    if prec == "fp8":  # each expert GEMM's input cast to FP8 (read 2 B, write 1 B per value)
        moved += copies * 3 * (h + ffn / plan.etp)
    return fwd, bwd, moved
