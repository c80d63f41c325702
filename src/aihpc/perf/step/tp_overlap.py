"""How much of a layer's tensor-parallel communication hides behind its GEMMs, by how the
framework overlaps it (``training.tp_comm_overlap``). A run fact, not a searched choice.

A layer has four TP linears: QKV and FC1 take their input gathered (column-parallel), the
attention projection and FC2 hand their output on reduced (row-parallel). With sequence
parallelism each exchange is an all-gather before a column linear and a reduce-scatter after a
row linear in the forward, and the reverse in the backward (the row linears' output gradient is
gathered, the column linears' input gradient reduce-scattered); without it, an all-reduce after
each row linear forward and after each column linear's input-gradient GEMM backward.

What hides, and what cannot, per framework:

- ``none``: nothing; every collective waits for its GEMM or the GEMM for it. Megatron-LM
  before September 2021 (``copy_to_tensor_model_parallel_region`` all-reduced the input
  gradient after the linear's whole backward; the async all-reduce came in on 2021-08-30,
  commit cf7efd4, and was made the default, ``--no-async-tensor-model-parallel-allreduce`` to
  turn it off, on 2021-09-02, 3f65246) and the forks of that code (BigScience's
  Megatron-DeepSpeed). PyTorch's DTensor TP too: the reduce-scatter of the input
  gradient is the backward of the all-gather, issued after the linear's backward node computed
  both gradients, and Inductor does not move collectives by default
  (``torch._inductor.config.reorder_for_compute_comm_overlap = False``).
- ``backward``: the column linears' input-gradient reduction runs beside their weight-gradient
  GEMM, the rest is exposed. Megatron-LM / Megatron-Core's
  ``LinearWithGradAccumulationAndAsyncCommunication.backward`` and Transformer Engine's
  ``Linear``/``LayerNormLinear`` backward ("Overlap dgrad-RS/AR with wgrad": the reduce-scatter
  or all-reduce of dgrad is launched async before the wgrad GEMM, waited for after it) do this
  by default. Exposed: whatever the collective takes beyond the weight-gradient GEMM.
- ``userbuffers``: Transformer Engine's comm-GEMM overlap (Megatron-Core ``--tp-comm-overlap``,
  NeMo ``ub_tp_comm_overlap``), every exchange forward and backward. ``initialize_ub`` in
  ``transformer_engine/pytorch/module/base.py`` picks per GEMM: ``ring_exchange`` for the
  gathers feeding QKV/FC1 forward and the proj/FC2 input-gradient GEMMs (the GEMM split into tp
  chunks, the local chunk first, each next chunk passed on around the ring while one is
  multiplied); ``pipeline`` for the reduce-scatters after proj/FC2 forward (``num_splits`` 4: a
  chunk's reduce-scatter beside the next chunk's GEMM, the last one's alone); ``bulk`` for the
  QKV/FC1 backward (the whole input-gradient reduce-scatter beside the whole weight-gradient
  GEMM). TE and Megatron-Core require sequence parallelism for it.
- ``async_tp``: PyTorch's micro-pipelined TP (torchtitan ``enable_async_tensor_parallel``,
  Inductor's ``_micro_pipeline_tp`` pass in ``torch/_inductor/fx_passes/micro_pipeline_tp.py``
  rewriting all-gather -> matmul and matmul -> reduce-scatter in the forward and backward
  graphs into ``fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``).
  ``torch/distributed/_symmetric_memory``: ``_pipelined_all_gather_and_consume`` multiplies
  the local shard first, then copies each peer's shard (copy engine, over SymmetricMemory) and
  multiplies it, alternating two streams; ``_pipelined_produce_and_all2all`` computes each
  peer's chunk and sends it while the next one is computed, the local chunk last. Both are
  tp chunks of a split GEMM (the pass needs sequence parallelism's all-gather/reduce-scatter
  pairs). Announced with "up to ~29% forward pass speedup and ~8% E2E speedup" on Llama 3 8B
  and 70B (PyTorch dev-discuss, "[Distributed w/ TorchTitan] Introducing Async Tensor
  Parallelism in PyTorch", 2024).

A chunked overlap of n chunks exposes, beyond the chunks it cannot overlap (the last
reduce-scatter chunk of ``pipeline``), every step whose transfer outlasts the GEMM chunk beside
it: (n - 1) x max(0, c / (n - 1) - g / n) for a ring of n - 1 transfers, n x max(0, c/n - g/n)
for n paired chunks. A collective hides behind at most ``overlap_efficiency`` of the GEMM
beside it, as data-parallel and context-parallel collectives do; the compute the hidden share
slows down (SM and memory contention) is ``overlap_compute_penalty`` of it, charged in
StepTerms.overlap_penalty. Not priced: the extra all-gather of the saved input a sequence-
parallel column linear repeats for its weight gradient (hidden behind the input-gradient GEMM
by all three overlapping modes) and async TP's final sum of the received partials.

Op-level selective checkpointing (``recompute = "op"``, torchtitan's per-op SAC) saves the
reduce-scatters' outputs but not the all-gathers' (its save list has
``_c10d_functional.reduce_scatter_tensor`` and no all-gather, "to avoid re-communication" of
the former: ``torchtitan/models/llama3/parallelize_llama.py`` at 820504e, June 2025, and
``torchtitan/distributed/activation_checkpoint.py`` since), so the backward gathers the
attention and MLP inputs again (``op_regather_s``): for the column GEMMs the policy recomputes
(every other matmul) and for every column linear's weight gradient. What
running a GEMM as chunks costs (smaller GEMMs, one launch each) is priced, as exposed time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aihpc.perf.step.flops import layer_gemms, mla_gemms, op_sac_saved
from aihpc.runspec.model import ModelSpec
from aihpc.runspec.parallel import ParallelPlan
from aihpc.runspec.training import TP_COMM_OVERLAPS

__all__ = [
    "TP_COMM_OVERLAPS",
    "TPGemms",
    "bulk_exposed_s",
    "layer_tp_comm_s",
    "op_recomputed_gemms",
    "op_regather_s",
    "pipeline_exposed_s",
    "ring_exposed_s",
    "tp_gemms",
]

# Transformer Engine's default chunk count of a ``pipeline`` reduce-scatter overlap
# (initialize_ub's default_cfg: "num_splits": tp_size if ring_exchange else 4).
UB_PIPELINE_SPLITS = 4


@dataclass(frozen=True)
class TPGemms:
    """Forward GEMM seconds of a layer's four TP linears for one micro-batch on one GPU (each
    linear's input-gradient and weight-gradient GEMMs take as long as its forward one)."""

    qkv: float  # column-parallel: attention input projections
    proj: float  # row-parallel: attention output projection
    fc1: float  # column-parallel: MLP input (gate and up)
    fc2: float  # row-parallel: MLP output


def tp_gemms(
    model: ModelSpec, plan: ParallelPlan, gemm: Any, moe_frac: float, chunks: int = 1
) -> TPGemms:
    """The four TP linears' forward GEMM seconds of a layer, mixed over dense and MoE layers
    (``gemm(m, n, k)``: compute.gemm_time_s on the run's part and precision), each run whole or
    as ``chunks`` GEMMs over its rows (the sum of the chunks' times). MLA: the down
    projections (replicated over TP) read the gathered input beside the up projections. An MoE
    layer's MLP linears are its shared experts (the routed experts run behind the expert
    dispatch, not between the TP collectives)."""
    t, rows = plan.tp, plan.micro_batch_size * model.seq_length / plan.cp
    h, d = model.hidden_size, model.kv_channels
    tokens = rows / chunks

    def gemm_all(m: float, n: float, k: float) -> float:
        return chunks * gemm(m, n, k)

    if model.is_mla:
        qkv = proj = 0.0
        for _, n_in, n_out, split in mla_gemms(model):
            if split == "row":
                proj += gemm_all(tokens, n_out, n_in / t)
            else:
                qkv += gemm_all(tokens, n_out / (t if split == "col" else 1), n_in)
    else:
        hq, hkv = model.num_attention_heads * d, model.kv_heads * d
        qkv, proj = gemm_all(tokens, (hq + 2 * hkv) / t, h), gemm_all(tokens, h, hq / t)
    gated = model.ffn_activation == "swiglu"

    def mlp(ffn: float) -> tuple[float, float]:
        if not ffn:
            return 0.0, 0.0
        f_in = 2 * ffn if gated else ffn
        return gemm_all(tokens, f_in / t, h), gemm_all(tokens, h, ffn / t)

    fc1, fc2 = mlp(model.ffn_hidden_size) if moe_frac < 1 else (0.0, 0.0)
    if moe_frac:
        shared = model.num_shared_experts * (model.expert_ffn_hidden_size or 0)
        s1, s2 = mlp(shared)
        fc1, fc2 = (1 - moe_frac) * fc1 + moe_frac * s1, (1 - moe_frac) * fc2 + moe_frac * s2
    return TPGemms(qkv, proj, fc1, fc2)


def bulk_exposed_s(comm_s: float, gemm_s: float, hide: float) -> float:
    """A whole collective beside a whole GEMM: what outlasts the GEMM."""
    return max(0.0, comm_s - hide * gemm_s)


def ring_exposed_s(comm_s: float, gemm_s: float, n: int, hide: float) -> float:
    """A gather of n chunks whose n - 1 transfers each run beside one GEMM chunk (the local one
    first): each transfer's excess over its chunk."""
    if n < 2:
        return 0.0
    return (n - 1) * max(0.0, comm_s / (n - 1) - hide * gemm_s / n)


def pipeline_exposed_s(comm_s: float, gemm_s: float, n: int, hide: float) -> float:
    """A GEMM in n chunks, each chunk's reduce-scatter beside the next chunk's GEMM: the last
    chunk's collective alone, and each earlier one's excess over its neighbour."""
    return comm_s / n + (n - 1) * max(0.0, comm_s / n - hide * gemm_s / n)


def _chunked(
    comm_s: float, whole_s: float, split_s: float, n: int, hide: float, ring: bool
) -> tuple[float, float]:
    """(the collective's exposed share, the GEMM's chunking cost) of a collective overlapped
    with its GEMM run as n chunks. ``split_s`` is the n chunks' total, each at its own size's
    efficiency with its own launch; what it exceeds the whole GEMM by is the chunking cost."""
    if ring:
        left = ring_exposed_s(comm_s, split_s, n, hide)
    else:
        left = pipeline_exposed_s(comm_s, split_s, n, hide)
    return left, max(0.0, split_s - whole_s)


def layer_tp_comm_s(
    mode: str,
    sequence_parallel: bool,
    tp: int,
    gather_s: float,
    reduce_s: float,
    gemms: tuple[TPGemms, TPGemms, TPGemms],
    hide: float,
) -> tuple[float, float, float, float]:
    """(forward exposed, forward hidden, backward exposed, backward hidden) TP communication of
    one layer for one micro-batch. With sequence parallelism ``gather_s`` / ``reduce_s`` are one
    all-gather / reduce-scatter of the layer's activations; without it ``reduce_s`` is one
    all-reduce and ``gather_s`` is unused. ``gemms``: the linears run whole, in tp chunks and in
    UB_PIPELINE_SPLITS chunks. userbuffers and async_tp need sequence parallelism (TE and
    Megatron-Core refuse it, the PyTorch pass matches only gather/scatter pairs): without it
    they run as ``backward``. Hidden: the collectives' time beside a GEMM; exposed: the rest,
    plus what running the GEMMs in chunks costs."""
    whole, by_tp, by_pipe = gemms
    col_bwd = bulk_exposed_s(reduce_s, whole.qkv, hide) + bulk_exposed_s(reduce_s, whole.fc1, hide)
    if not sequence_parallel:
        total = 2 * reduce_s
        bwd_x = total if mode == "none" else col_bwd
        return total, 0.0, bwd_x, total - bwd_x
    a, r = gather_s, reduce_s
    total = 2 * (a + r)
    if mode in ("none", "backward"):
        bwd_x = total if mode == "none" else 2 * a + col_bwd
        return total, 0.0, bwd_x, total - bwd_x

    def over(comm: float, name: str, split: TPGemms, n: int, ring: bool) -> tuple[float, float]:
        return _chunked(comm, getattr(whole, name), getattr(split, name), n, hide, ring)

    # Forward: gathers into QKV and FC1; reduce-scatters out of proj and FC2. Backward: the
    # output-gradient gathers into proj's and FC2's input-gradient GEMMs, and the input-
    # gradient reduce-scatters out of QKV's and FC1's (each GEMM the size of the forward one).
    fwd = [over(a, "qkv", by_tp, tp, True), over(a, "fc1", by_tp, tp, True)]
    bwd = [over(a, "proj", by_tp, tp, True), over(a, "fc2", by_tp, tp, True)]
    if mode == "userbuffers":
        n = UB_PIPELINE_SPLITS
        fwd += [over(r, "proj", by_pipe, n, False), over(r, "fc2", by_pipe, n, False)]
        bwd += [(col_bwd, 0.0)]  # bulk: beside the weight-gradient GEMMs
    else:  # async_tp: every reduce-scatter micro-pipelined with the GEMM producing it
        fwd += [over(r, "proj", by_tp, tp, True), over(r, "fc2", by_tp, tp, True)]
        bwd += [over(r, "qkv", by_tp, tp, True), over(r, "fc1", by_tp, tp, True)]
    fwd_left, fwd_cost = (sum(x) for x in zip(*fwd, strict=True))
    bwd_left, bwd_cost = (sum(x) for x in zip(*bwd, strict=True))
    return fwd_left + fwd_cost, total - fwd_left, bwd_left + bwd_cost, total - bwd_left


def op_recomputed_gemms(
    model: ModelSpec, plan: ParallelPlan, gemm: Any, moe_frac: float
) -> tuple[tuple[float, float], tuple[float, float]]:
    """Per sequence-parallel gather (attention input, MLP input): (whole, in tp chunks) forward
    seconds of the column GEMMs op-level checkpointing recomputes from it (``op_sac_saved``:
    every other matmul; Llama's wk and w3). MLA's projections and MoE layers' routed experts are
    not counted (no recomputed TP column GEMM is known to read those gathers)."""
    t, rows = plan.tp, plan.micro_batch_size * model.seq_length / plan.cp
    attn, mlp = [0.0, 0.0], [0.0, 0.0]
    for i, (name, n_in, n_out, row) in enumerate(layer_gemms(model)):
        if row or op_sac_saved(i) or (model.is_mla and name in ("wq", "wk", "wv")):
            continue
        share = 1.0 if name in ("wq", "wk", "wv") else 1.0 - moe_frac
        into = attn if name in ("wq", "wk", "wv") else mlp
        into[0] += share * gemm(rows, n_out / t, n_in)
        into[1] += share * t * gemm(rows / t, n_out / t, n_in)
    return (attn[0], attn[1]), (mlp[0], mlp[1])


def op_regather_s(
    mode: str, gather_s: float, recomputed: tuple[tuple[float, float], ...], tp: int, hide: float
) -> tuple[float, float]:
    """(exposed, hidden) seconds of the two sequence-parallel all-gathers (attention input, MLP
    input) op-level checkpointing runs again in one layer's backward. ``recomputed`` (read under
    ``async_tp`` only): per gather, (whole, in tp chunks) seconds of the column GEMMs the policy
    recomputes from it (``op_recomputed_gemms``). Only ``async_tp`` hides one, micro-pipelined
    with such a GEMM as in the forward; a gather no recomputed GEMM reads feeds only weight
    gradients, where the gathered dimension is the contraction, which the pass does not
    pipeline, so it is exposed, as both are in every other mode."""
    total = 2 * gather_s
    if mode != "async_tp":
        return total, 0.0
    left = cost = 0.0
    for whole, split in recomputed:
        if whole > 0.0:
            a, c = _chunked(gather_s, whole, split, tp, hide, True)
            left, cost = left + a, cost + c
        else:
            left += gather_s
    return left + cost, total - left
