"""The data-parallel terms of a step: gradient reduction and ZeRO / FSDP parameter gathers, by
ZeRO stage, exposed and hidden, and the routed experts' reduction over the expert-data-parallel
group. Each takes the ``StepState`` (step_state.py: a ``StepTerms``) of one plan or arrays; over
arrays, the plans of each ZeRO case are priced together and each distinct stage split's
collectives once.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from aihpc.perf.step import fsdp_host
from aihpc.perf.step.dtensor_host import stage_tensors
from aihpc.perf.step.flops import (
    embedding_params,
    param_tensors_per_layer,
    persistent_tensors_per_layer,
)
from aihpc.perf.step.gemm import stream_time_s
from aihpc.perf.step.memory import DTYPE_BYTES
from aihpc.perf.step.numeric import any_, maximum, minimum, where
from aihpc.perf.step.plan_batch import group, layer_params_split, subgroup
from aihpc.perf.step.step_state import StepState

__all__ = ["dp_comm", "expert_dp_comm"]


def _dp_setup(st: StepState) -> None:
    """The stage's parameters and the data-parallel groups. Gradients are reduced over dp x cp
    replicas, cp ranks tp apart (dp ranks tp x cp apart without CP); the first stage holds the
    embedding and, without PP, the untied output layer too."""
    b, model, training = st.b, st.model, st.training
    st.dp_n, st.zero, st.pp = b.dp * b.cp, b.zero, b.pp
    # the trainer runs PyTorch's DDP where the plan is data-parallel only at ZeRO 0 (else FSDP2:
    # runtime/parallelize.py, dtensor_host.dtensor_params)
    st.plain_ddp = (b.tp == 1) & (b.pp == 1) & (b.cp == 1) & (b.ep == 1) & (b.zero == 0)
    st.stride = where(b.cp > 1, b.tp, b.tp * b.cp)
    st.embeddings = where((b.pp > 1) | model.tied_embeddings, 1, 2)
    st.layer_params, st.expert_params = layer_params_split(model, st.layers, b.tp, b.etp, b.ep)
    emb = embedding_params(model)
    st.params_stage = st.layer_params + st.embeddings * emb / b.tp
    # Gradient reduction in grad_reduce_dtype (fp32: Megatron's bf16 default and FSDP2's in
    # torchtitan; bf16: NeMo's grad_sync_dtype).
    st.grad_bytes = DTYPE_BYTES[training.grad_reduce_dtype] * st.params_stage
    # Parameter gathers move 16-bit weights, the layers' ones in FP8 with fp8_param_gather;
    # fp32 ones where training.param_dtype says so (auto: fp32 where the host is the device,
    # as aihpc's CPU trainer gathers them; runtime/speed.py).
    st.gather_bytes = 4.0 if _gathers_fp32(training, st.cluster.gpu.host_is_device) else 2.0
    st.layer_weight_bytes = 1.0 if training.fp8_param_gather else st.gather_bytes
    st.param_bytes = st.layer_weight_bytes * st.layer_params + st.gather_bytes * (
        st.params_stage - st.layer_params
    )
    # HSDP: ZeRO shards over shard_n ranks only; each reduce-scattered gradient shard is then
    # all-reduced across the dp_n / shard_n replicas (PyTorch FSDP2's HSDP, Zhao et al. VLDB'23
    # §3.2.1; Megatron's num_distributed_optimizer_instances).
    shard_group = b.dp_shard or b.dp
    st.shard_n = where(b.zero > 0, shard_group * b.cp, st.dp_n)
    if not b.one:
        st.struct_one, st.struct = group(st.layers, b.tp, b.pp, b.vpp, b.cp, b.zero, b.ep, b.etp)


def _gathers_fp32(training: Any, host_is_device: bool) -> bool:
    return training.param_dtype == "fp32" or (training.param_dtype == "auto" and host_is_device)


def _dp_collective(st: StepState, kind: str, size: Any, idx: Any) -> Any:
    """One data-parallel collective of the plans ``idx`` (None: the one plan): all-reduce over
    dp x cp, ZeRO's gathers and reduce-scatters over the shard group; under HSDP the
    reduce-scattered shard is then all-reduced across the replicas."""
    dp_n, shard_n, stride = st.dp_n, st.shard_n, st.stride
    if idx is not None:
        dp_n, shard_n, stride = dp_n[idx], shard_n[idx], stride[idx]
    one = st.collective(kind, size, dp_n if kind == "all_reduce" else shard_n, stride)
    if kind == "reduce_scatter":
        hsdp = shard_n < dp_n
        if any_(hsdp):
            groups = where(hsdp, dp_n // shard_n, 1)
            extra = st.collective("all_reduce", size / shard_n, groups, stride * shard_n)
            one = where(hsdp, one + extra, one)
    return one


def _dp_sizes(st: StepState) -> None:
    """What the gathers and reductions move and what they can hide behind.

    A gradient reduction hides behind the last micro-batch's backward, or nothing when the
    framework reduces only after the whole backward. The edge bucket: the parameters used first
    in the forward and whose gradients are ready last in the backward, so its gather and its
    reduction have nothing to hide behind. Megatron-Core's distributed optimizer puts the
    (shared) embedding in a bucket of its own (param_and_grad_buffer.py,
    _does_param_require_new_bucket) and launches that bucket's all-gather just before the
    forward (distrib_optimizer.py, zero_grad); DDP's last bucket holds the embedding too
    (buckets fill in reverse parameter order). FSDP2 (torchtitan) shards the root module,
    embedding plus untied output layer, as one unit gathered at the start of the forward and
    reduced after the backward; so does the trainer's eager FSDP2 under ZeRO 1 and 2
    (fsdp_host.py)."""
    b, hide = st.b, st.params.overlap_efficiency
    if st.training.grad_reduce_overlap:
        st.last_bwd = hide * (st.layers * (st.bwd_layer + st.recompute_layer))
    else:
        st.last_bwd = b.zeros()
    st.first_fwd = hide * (st.layers * st.fwd_layer)
    root = (b.zero >= 1) if fsdp_host.eager_fsdp(st.training) else (b.zero == 3)
    edge = where(root, st.embeddings, 1) * embedding_params(st.model) / b.tp
    st.edge_frac = minimum(1.0, edge / st.params_stage)
    st.edge_param_bytes = st.gather_bytes * minimum(edge, st.params_stage - st.layer_params)
    st.body_param_bytes = st.param_bytes - st.edge_param_bytes


class _Rows:
    """The StepState figures of the plans ``i``: what a term of a subset of the plans reads
    (for one plan the term reads the StepState itself)."""

    def __init__(self, st: StepState, i: np.ndarray) -> None:
        self._st, self._i = st, i

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._st, name)
        return value[self._i] if isinstance(value, np.ndarray) else value


def _dp_cases(st: StepState) -> list[tuple[Any, Any]]:
    """(which plans, the term that prices them) by ZeRO stage."""
    b = st.b
    on, keeps = st.dp_n > 1, (b.zero == 3) & (b.pp > 1)
    per_tensor = st.training.zero3_gather == "per_tensor"
    return [
        (on & (b.zero == 0), _dp_zero0),
        (on & ((b.zero == 1) | (b.zero == 2)), _dp_zero12),
        (on & keeps, _dp_zero3_pp),
        (on & (b.zero == 3) & (b.pp <= 1), _per_tensor_zero3 if per_tensor else _dp_zero3),
    ]


def dp_comm(st: StepState, compute_mb: Any, recompute_mb: Any) -> tuple[Any, Any]:
    """Data-parallel gradient reduction and ZeRO gathers, exposed and hidden, by ZeRO stage."""
    _dp_setup(st)
    _dp_sizes(st)
    b, hide = st.b, st.params.overlap_efficiency
    if b.one:
        for on, term in _dp_cases(st):
            if on:

                def coll(kind: str, size: Any) -> Any:
                    return _dp_collective(st, kind, size, None)

                return term(st, coll, hide * (compute_mb + recompute_mb))
        return 0.0, 0.0
    dp_time, hidden = np.zeros(len(b)), np.zeros(len(b))
    for mask, term in _dp_cases(st):
        i = np.nonzero(mask)[0]
        if not len(i):
            continue
        # The collectives' sizes and groups follow from the stage split and the degrees alone:
        # priced once per distinct split, then gathered to every plan that has it.
        rep, inv = subgroup(st.struct_one, st.struct, i, mask)

        def c(kind: str, size: np.ndarray, i: np.ndarray = i) -> np.ndarray:
            return _dp_collective(st, kind, size[rep], i[rep])[inv]  # noqa: B023

        window = hide * (compute_mb[i] + recompute_mb[i])
        dp_time[i], hidden[i] = term(_Rows(st, i), c, window)
    return dp_time, hidden


Coll = Any  # (kind, sizes of the plans) -> seconds


def _dp_zero0(r: Any, c: Coll, window: Any) -> tuple:
    """DDP: one all-reduce after the backward, or bucketed behind it but for the edge bucket;
    PyTorch's DDP copies each gradient into its bucket and back (``_ddp_copies``)."""
    gb, ef = r.grad_bytes, r.edge_frac
    if not r.training.grad_reduce_overlap:
        return c("all_reduce", gb) + _ddp_copies(r), 0.0 * gb
    tail = c("all_reduce", gb * ef)
    rest = c("all_reduce", gb * (1 - ef))
    exposed = maximum(0.0, rest - r.last_bwd)
    return tail + exposed + _ddp_copies(r), rest - exposed


# PyTorch DDP's reducer (gradient_as_bucket_view off, its default and the trainer's): each
# gradient copied into its bucket when ready (copy_ reads it, writes the bucket) and the
# all-reduced bucket copied back into the gradient; in the synchronising micro-batch only.
DDP_COPY_PASSES = 4  # bytes read and written over the gradients: 2 copies x (read + write)


def _ddp_copies(r: Any) -> Any:
    """Seconds of PyTorch DDP's gradient copies on the training thread, once a step (the
    trainer's runtime/parallelize.py DDP; counted in tests/perf/test_fsdp_host.py), under the
    trainer's PyTorch-native data parallelism (``fsdp_host.eager_fsdp``: dtensor_dispatch
    eager); 0 otherwise (Megatron-Core's DDP reduces its contiguous gradient buffer in place)."""
    if not fsdp_host.eager_fsdp(r.training):
        return 0.0 * r.grad_bytes
    tensors, _ = stage_tensors(r.layers, r.pp, r.model.tied_embeddings)
    gpu, params = r.cluster.gpu, r.params
    copies = stream_time_s(DDP_COPY_PASSES * r.grad_bytes, gpu, params, kernels=2 * tensors)
    return where(r.plain_ddp, copies, 0.0)


def _dp_zero12(r: Any, c: Coll, window: Any) -> tuple:
    """Distributed optimizer: reduce-scatter the gradients, all-gather the updated weights."""
    if fsdp_host.eager_fsdp(r.training):
        return _fsdp_zero12(r, c, window)
    gb, ef = r.grad_bytes, r.edge_frac
    tail = c("reduce_scatter", gb * ef)
    head = c("all_gather", r.edge_param_bytes)
    grads = c("reduce_scatter", gb * (1 - ef))
    gather = c("all_gather", r.body_param_bytes)
    exp_g = maximum(0.0, grads - r.last_bwd)
    exp_a = maximum(0.0, gather - r.first_fwd)
    return tail + head + exp_g + exp_a, grads + gather - exp_g - exp_a


def _dp_zero3_pp(r: Any, c: Coll, window: Any) -> tuple:
    """FSDP2 under PP: one gather of the stage before its first forward, one reduce-scatter
    after its last backward, hidden like ZeRO-1/2's."""
    gb, ef = r.grad_bytes, r.edge_frac
    head = c("all_gather", r.edge_param_bytes)
    tail = c("reduce_scatter", gb * ef)
    gather = c("all_gather", r.body_param_bytes)
    grads = c("reduce_scatter", gb * (1 - ef))
    exp = maximum(0.0, gather - r.first_fwd) + maximum(0.0, grads - r.last_bwd)
    # eager FSDP2's copies: one gather and one reduction of the stage (fsdp_host.py)
    return head + tail + exp + _fsdp_copies(r, 1, 1), gather + grads - exp


def _dp_zero3(r: Any, c: Coll, window: Any) -> tuple:
    """ZeRO-3 / FSDP: one gather per layer for forward and backward, one reduce-scatter, per
    micro-batch; the root unit (edge) gathered before the first layer and reduced after the
    last backward, on the critical path each time."""
    if fsdp_host.eager_fsdp(r.training):
        return _fsdp_zero3(r, c, window)
    gb, ef, layers, m = r.grad_bytes, r.edge_frac, r.layers, r.m
    body_p = r.body_param_bytes / layers
    body_g = gb * (1 - ef) / layers
    per_mb = layers * (2 * c("all_gather", body_p) + c("reduce_scatter", body_g))
    edges = c("all_gather", r.edge_param_bytes) + c("reduce_scatter", gb * ef)
    exposed = maximum(0.0, per_mb - window)
    return m * (exposed + edges), m * (per_mb - exposed)


def _fsdp_zero3(r: Any, c: Coll, window: Any) -> tuple:
    """ZeRO-3 as the trainer's eager FSDP2 runs it (fsdp_host.collectives, counted): every unit,
    the root too, gathered for the forward and again for the backward of each micro-batch; the
    gradients reduce-scattered once, in the last micro-batch (the trainer syncs gradients there
    only); and the copies around each."""
    gb, ef, layers, m = r.grad_bytes, r.edge_frac, r.layers, r.m
    gathers = layers * 2 * c("all_gather", r.body_param_bytes / layers)
    grads = layers * c("reduce_scatter", gb * (1 - ef) / layers)
    edges = m * 2 * c("all_gather", r.edge_param_bytes) + c("reduce_scatter", gb * ef)
    exp_rest = maximum(0.0, gathers - window)
    exp_last = maximum(0.0, gathers + grads - window)
    exposed = (m - 1) * exp_rest + exp_last + edges + _fsdp_copies(r)
    return exposed, (m - 1) * (gathers - exp_rest) + gathers + grads - exp_last


def _fsdp_copies(r: Any, m: Any = None, zero: Any = None) -> Any:
    """FSDP2's copies around its gathers and reductions on the training thread, under eager
    FSDP2 (fsdp_host.py), for ``m`` micro-batches at ``zero`` (the plans' own by default); 0
    otherwise (Megatron-Core's buffers are gathered in place)."""
    if not fsdp_host.eager_fsdp(r.training):
        return 0.0 * r.grad_bytes
    m, zero = r.m if m is None else m, r.zero if zero is None else zero
    gpu, params = r.cluster.gpu, r.params
    return fsdp_host.copy_time_s(
        r.param_bytes, r.grad_bytes, r.shard_n, r.layers, m, zero, gpu, params, r.pp
    )


def _fsdp_zero12(r: Any, c: Coll, window: Any) -> tuple:
    """ZeRO 1/2 as the trainer's eager FSDP2 runs them (fsdp_host.py): per layer unit a gather
    before its forward in every micro-batch, hidden behind that micro-batch's forward, and a
    reduce-scatter after the last backward, hidden behind it; the root unit's gather and
    reduction exposed; and the copies around each. Under PP the schedule gathers each unit once
    a step (torch.distributed.pipelining unshards before the first micro-batch)."""
    gb, ef, layers = r.grad_bytes, r.edge_frac, r.layers
    _, m, _ = fsdp_host.collectives(layers, r.m, 1, r.pp)  # gathers per unit a step
    gathers = layers * c("all_gather", r.body_param_bytes / layers)
    grads = layers * c("reduce_scatter", gb * (1 - ef) / layers)
    edges = m * c("all_gather", r.edge_param_bytes) + c("reduce_scatter", gb * ef)
    exp_a = maximum(0.0, gathers - r.first_fwd)
    exp_g = maximum(0.0, grads - r.last_bwd)
    exposed = edges + m * exp_a + exp_g + _fsdp_copies(r)
    return exposed, m * (gathers - exp_a) + grads - exp_g


def _per_tensor_zero3(r: Any, coll: Coll, window: Any) -> tuple:
    """DeepSpeed 0.3 ZeRO-3 (partition_parameters.py _allgather_param, stage3.py
    fetch_sub_module): each tensor gathered alone after torch.cuda.synchronize(), so gathers
    never overlap compute; forward, backward and (full recompute) the recompute each gather
    again. List-based collectives copy every one of the n partitions with its own kernel (out
    of the flat buffer for all-gather, into it for reduce-scatter); the reduce-scatter itself
    runs on a side stream behind the backward. Each gather also zero-fills its fresh buffer and
    the copies move its bytes once more (3 x S through HBM); the reduce-scatter's input copies
    move 2 x S. Tensors under stage3_param_persistence_threshold (biases, norms) stay gathered
    (stage3.py release_sub_module skips ds_persist): only the layers' matrices and the
    embeddings are gathered per pass; after the optimizer step the small ones are gathered
    once (_post_step), each copied out of every rank's slice by a Python loop
    (partition_parameters.py _allgather_params). The per-partition lists are built in Python
    on the training thread: per rank, the all-gather takes one view (`flat_tensor.narrow`) and
    one copy kernel; the reduce-scatter two views and one copy kernel; the post-step copy
    three views and a `copy_` called from Python."""
    model, params, gpu = r.model, r.params, r.cluster.gpu
    layers, m, dp_n = r.layers, r.m, r.dp_n
    param_bytes, grad_bytes = r.param_bytes, r.grad_bytes
    tensors = layers * param_tensors_per_layer(model)
    persistent = layers * persistent_tensors_per_layer(model)
    gathered = tensors - persistent + 2  # + word and position embeddings
    gathers = where(r.full, 3, 2)
    view, launch = params.host_op_overhead_s, params.kernel_overhead_s
    ag_part = dp_n * (view + launch)
    ag = gathered * (coll("all_gather", param_bytes / gathered) + ag_part)
    ag += stream_time_s(3 * param_bytes, gpu, params, kernels=0)
    rs_part = dp_n * (2 * view + launch)
    rs_copies = tensors * rs_part + stream_time_s(2 * grad_bytes, gpu, params, 0)
    rs = tensors * coll("reduce_scatter", grad_bytes / tensors)
    rs_exposed = maximum(0.0, rs - r.last_bwd)
    small = 2.0 * persistent * 4 * model.hidden_size  # bytes, at most 4h each
    post_part = dp_n * (4 * view + launch)
    post_step = persistent * post_part + ag_part + coll("all_gather", small)
    return m * (gathers * ag + rs_copies + rs_exposed) + post_step, m * (rs - rs_exposed)


def _expert_times(r: Any, coll: Coll) -> Any:
    """Routed experts' gradients reduced (and, sharded, their weights gathered) over the
    expert-data-parallel group, etp x ep ranks apart; ZeRO-3 without PP does it again for
    every micro-batch."""
    e_grad = DTYPE_BYTES[r.training.grad_reduce_dtype] * r.expert_params
    ar = coll("all_reduce", e_grad)
    rs = coll("reduce_scatter", e_grad) + coll("all_gather", r.layer_weight_bytes * r.expert_params)
    rs = where((r.zero == 3) & (r.pp <= 1), rs * r.m, rs)
    return where(r.edp > 1, where(r.zero == 0, ar, rs), 0.0)


def expert_dp_comm(st: StepState, dp_time: Any, hidden: Any) -> tuple[Any, Any]:
    """Routed experts' gradients over the expert-data-parallel group, in the window the dense
    part leaves."""
    b = st.b
    st.edp = maximum(1, b.tp * b.cp * b.dp // (b.etp * b.ep))
    st.e_stride, st.zero, st.pp = b.etp * b.ep, b.zero, b.pp
    if b.one:
        if not st.expert_params:
            return dp_time, hidden

        def one(kind: str, size: Any) -> Any:
            return st.collective(kind, size, st.edp, st.e_stride)

        e_time = _expert_times(st, one)
        return _expert_exposed(st, e_time, dp_time, hidden)
    i = np.nonzero(st.expert_params != 0)[0]
    if not len(i):
        return dp_time, hidden
    # as in dp_comm: once per distinct stage split
    rep, inv = subgroup(st.struct_one, st.struct, i, st.expert_params != 0)
    r = _Rows(st, i)

    def c(kind: str, size: np.ndarray) -> np.ndarray:
        return st.collective(kind, size[rep], r.edp[rep], r.e_stride[rep])[inv]

    e_time = _expert_times(r, c)
    dp_time, hidden = dp_time.copy(), hidden.copy()
    dp_time[i], hidden[i] = _expert_exposed(r, e_time, dp_time[i], hidden[i])
    return dp_time, hidden


def _expert_exposed(r: Any, e_time: Any, dp_time: Any, hidden: Any) -> tuple[Any, Any]:
    """(dp_time, hidden) with the expert reduction added: hidden in what the dense part's
    reduction left of the backward (and forward) window, the rest exposed."""
    hide = r.params.overlap_efficiency
    layers_bwd = r.layers * (r.bwd_layer + r.recompute_layer)
    room = hide * (layers_bwd + r.layers * r.fwd_layer) if r.training.grad_reduce_overlap else 0.0
    e_exposed = maximum(0.0, e_time - maximum(0.0, room - hidden))
    return dp_time + e_exposed, hidden + (e_time - e_exposed)
