"""The memory of the most loaded GPU as named terms, for one plan (``PlanBatch.of``: plain Python
numbers, ``memory_breakdown`` below) or numpy arrays of plans (the search's total): weights,
gradients and optimizer state by ZeRO stage (``_state_bytes``); activations in flight under
1F1B, interleaving and ZB-V, with offloaded layers and the recompute's working set; the
embedding, logits and loss buffers; FSDP2's lazily created gradients (``_lazy``: the peak over
the schedule); runtime overhead and fragmentation. memory.py explains each with its sources.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from aihpc.perf.step.batch_shapes import Shapes
from aihpc.perf.step.flops import embedding_params
from aihpc.perf.step.memory import (
    DTYPE_BYTES,
    MOMENTS,
    GiB,
    MemoryBreakdown,
    activation_bytes_per_layer,
    largest_param_tensor,
    lazy_grad_points,
)
from aihpc.perf.step.numeric import any_, maximum, minimum, where
from aihpc.perf.step.params import DEFAULT_PARAMS, ModelParams
from aihpc.perf.step.plan_batch import A2A_DUALPIPE, FULL, OP, PlanBatch, group, layer_params_split
from aihpc.runspec.cluster import ClusterSpec
from aihpc.runspec.model import ModelSpec
from aihpc.runspec.parallel import ParallelPlan
from aihpc.runspec.training import TrainingSpec

__all__ = ["MemoryTerms", "memory_breakdown", "memory_total"]


def _state_bytes(
    params_local: Any, zero: Any, pp: Any, d: Any, training: TrainingSpec, layer_local: Any
) -> tuple[Any, Any, Any]:
    """(weights, gradients, optimizer) bytes for ``params_local`` parameters on this rank, ``d``
    ranks sharing (sharding) the states: all dp x cp, HSDP's group, or the routed experts'
    expert-data-parallel replicas.

    zero 0-2 follow Megatron-LM: 16-bit weights, fp32 main gradients, fp32 master + Adam m, v
    (18 B/param unsharded). zero 3 follows FSDP2 with mixed precision: the sharded fp32
    parameter is the master copy, gradients are reduced to fp32 shards, plus the 16-bit
    parameters of the layers being gathered (current + prefetched) and one layer's gradients
    (with ``zero3_gather = "per_tensor"``, DeepSpeed 0.3's, the largest tensor instead of a layer).
    Under pipeline parallelism FSDP2 keeps the stage's parameters gathered across the step's
    micro-batches and accumulates unsharded fp32 gradients, reduce-scattering once at the end
    (torchtitan disables resharding after forward with PP): the stage then holds a full 16-bit
    copy of its weights and a full fp32 gradient. ``grad_reduce_dtype`` and ``optimizer_dtype``
    = bf16 halve the gradient and the master/moment bytes. FP8 runs keep FP8 copies of the
    weights too."""
    g, o = DTYPE_BYTES[training.grad_reduce_dtype], DTYPE_BYTES[training.optimizer_dtype]
    moments = MOMENTS[training.optimizer]
    fp8_cache = 1.0 if training.precision == "fp8" else 0.0
    z3, keeps = zero == 3, (zero == 3) & (pp > 1)
    w3 = o * params_local / d + where(
        keeps, (2 + fp8_cache) * params_local, (2 + fp8_cache) * 2 * layer_local
    )
    g3 = g * params_local / d + where(keeps, g * params_local, g * layer_local)
    o3 = moments * o * params_local / d
    w = (2 + fp8_cache) * params_local
    gr = g * params_local / where(zero == 2, d, 1)
    op = (1 + moments) * o * params_local / where(zero >= 1, d, 1)
    return where(z3, w3, w), where(z3, g3, gr), where(z3, o3, op)


def memory_total(
    model: ModelSpec,
    training: TrainingSpec,
    params: ModelParams,
    b: PlanBatch,
    sh: Shapes,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(memory_breakdown(...).total, .offloaded, activation bytes per layer) over arrays."""
    act_layer, act_none = sh.by_rec(sh.act, b.rec), sh.act_none[sh.inv]
    return MemoryTerms(model, training, params, b, act_layer, act_none).total()


class MemoryTerms:
    """The most loaded stage's memory of one plan or of arrays of plans. ``act_layer``: the
    activation bytes one layer keeps per micro-batch under the plan's recompute policy;
    ``act_none``: the same without recompute."""

    def __init__(
        self,
        model: ModelSpec,
        training: TrainingSpec,
        params: ModelParams,
        b: PlanBatch,
        act_layer: Any,
        act_none: Any,
    ) -> None:
        self.model, self.training, self.params, self.b = model, training, params, b
        p, v = b.pp, b.vpp
        self.m = m = b.global_batch_size // (b.dp * b.mbs)
        self.lps = -(-model.num_layers // (p * v)) * v
        one = 1 if b.one else np.ones(len(b), np.int64)
        one_dense, one_exp = layer_params_split(model, one, b.tp, b.etp, b.ep)
        self.layer_local = where(one_exp != 0, one_dense + one_exp, one_dense)
        if training.zero3_gather == "per_tensor":  # DeepSpeed 0.3 holds one tensor at a time
            self.layer_local = largest_param_tensor(model) / b.tp
        self.emb_local = embedding_params(model) / b.tp
        self.act_layer = act = act_layer
        # While a layer is recomputed its full activations live; what it kept is counted already.
        recomputed = (b.rec == FULL) | (b.rec == OP)
        self.working = where(recomputed, maximum(0.0, act_none - act), 0.0)
        self._in_flight(p, v, m)
        tokens = b.mbs * model.seq_length / b.cp
        # Output layer, per vocab shard: 16-bit logits plus the fp32 copy a fused vocab-parallel
        # cross-entropy (fused or not) works on in place (Megatron-LM, NeMo): 6 B per logit.
        # PyTorch's F.cross_entropy on upcast logits also keeps its fp32 log-softmax output and,
        # in the backward, an fp32 gradient of the logits: 14 B. Plus the final-norm and
        # output-GEMM inputs; the embedding's output is held per micro-batch in flight.
        loss_bytes = 14 if training.cross_entropy == "eager" else 6
        self.logits = tokens * (loss_bytes * model.vocab_size / b.tp + 4 * model.hidden_size)
        mb = self.mb
        self.embed_out = tokens * model.hidden_size * 2 * where(p > 1, mb, 1) / where(b.sp, b.tp, 1)
        # FSDP2's lazily created gradients (memory.fsdp_lazy_grads); the walk follows 1F1B /
        # interleaved order, so ZB-V's is priced as the plain sum.
        self.lazy = (b.zero == 3) & (training.zero3_gather == "bucketed") & (b.pp_schedule != "zbv")
        if not b.one:
            self.lazy_idx = i = np.nonzero(self.lazy)[0]
            self.lazy_groups = group(p[i], v[i], m[i]) if len(i) else (i, i)

    def _in_flight(self, p: Any, v: Any, m: Any) -> None:
        """Activations held at the peak. 1F1B: stage 0 holds min(p, m) micro-batches of its
        layers. Interleaved: its warm-up runs 2(p-1) + (v-1)p model chunks ahead, so p v + p - 1
        chunks of L/v layers are live, i.e. (1 + (p-1)/(p v)) times 1F1B's (Narayanan et al.
        SC'21, sec. 2.2.2), but never more than the m v chunks a step has. The last stage: one
        micro-batch under 1F1B; interleaved, its warm-up still runs (v-1)p chunks ahead, so
        (v-1)p + 1 chunks are live (``warmup_chunks`` + 1). DualPipe: p + 1 micro-batches of
        a stage (DeepSeek-V3 Table 2). ZB-V keeps 1F1B's activation memory,
        p micro-batches of a stage's layers (Qi et al. 2024, their comparison table), and rank 0
        holds the first and the last chunk. Offloaded layers' activations are in host memory
        (``memory.offload_split``: never fewer than two layers on the GPU)."""
        b, act, lps = self.b, self.act_layer, self.lps
        self.mb = mb = minimum(p, m)
        self.zbv_acts = act * lps * mb + self.working
        in_flight = where(
            v > 1, minimum(m, (minimum(2 * (p - 1) + (v - 1) * p, m * v) + 1) / v), mb
        )
        # DualPipe holds PP + 1 micro-batches of a stage's activations (DeepSeek-V3 Table 2).
        in_flight = where(b.a2a == A2A_DUALPIPE, minimum(p + 1, m), in_flight)
        last_in_flight = where(v > 1, minimum(m, (minimum((v - 1) * p, m * v) + 1) / v), 1)
        off = b.offload
        self.resident = where(off > 0, maximum(lps - off, minimum(lps, 2)), lps)
        self.offloaded = where(off > 0, off, 0)
        self.first_acts = act * self.resident * in_flight + self.working
        self.last_acts = act * lps * last_in_flight + self.working

    def total(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(total bytes, offloaded bytes, activation bytes per layer) of arrays of plans."""
        b, model = self.b, self.model
        single = b.pp == 1
        n = len(b)
        both = self.logits + self.embed_out
        only = _sum(self.stage(np.full(n, model.num_layers), True, True, self.first_acts, both))
        if b.pp_schedule == "zbv":
            multi = _sum(self.stage(self.lps, True, True, self.zbv_acts, both, "first"))
        else:
            first = _sum(self.stage(self.lps, True, False, self.first_acts, self.embed_out))
            last = _sum(self.stage(self.lps, False, True, self.last_acts, self.logits, "last"))
            multi = np.where(first >= last, first, last)
        total = np.where(single, only, multi)
        return total, self.act_layer * self.offloaded, self.act_layer

    def breakdown(self) -> MemoryBreakdown:
        """The most loaded stage (first or last) of one plan, part by part."""
        b, model = self.b, self.model
        both = self.logits + self.embed_out
        if b.pp == 1:
            return self._parts(model.num_layers, True, True, self.first_acts, both, "only")
        if b.pp_schedule == "zbv":  # rank 0 holds the first and the last chunk
            return self._parts(self.lps, True, True, self.zbv_acts, both, "first")
        first = self._parts(self.lps, True, False, self.first_acts, self.embed_out, "first")
        last = self._parts(self.lps, False, True, self.last_acts, self.logits, "last")
        return first if first.total >= last.total else last

    def _parts(self, *args: Any) -> MemoryBreakdown:
        w, g, o, acts, buffers, other, later = self.stage(*args)
        off = self.act_layer * self.offloaded
        return MemoryBreakdown(w, g, o, acts, buffers, other, args[-1], off, later)

    def stage(
        self,
        layer_count: Any,
        embed: bool,
        output: bool,
        acts: Any,
        buffers: Any,
        name: str = "first",
    ) -> tuple[Any, ...]:
        """(weights, gradients, optimizer, activations, buffers, other, gradients created after
        the peak) of a stage of ``layer_count`` layers, with the embedding and / or output layer.
        Routed experts' states are sharded over their expert-data-parallel ranks; DualPipe keeps
        a second copy of the stage's weights (DeepSeek-V3 Table 2)."""
        b, model, training, params = self.b, self.model, self.training, self.params
        params_local, expert_local = layer_params_split(model, layer_count, b.tp, b.etp, b.ep)
        if embed:
            params_local = params_local + self.emb_local
        if output and (not model.tied_embeddings or not embed):
            params_local = params_local + self.emb_local
        d = (b.dp_shard or b.dp) * b.cp
        w, g, o = _state_bytes(params_local, b.zero, b.pp, d, training, self.layer_local)
        has_e = expert_local != 0
        if any_(has_e):
            edp = maximum(1, b.tp * b.cp * b.dp // (b.etp * b.ep))
            we, ge, oe = _state_bytes(expert_local, b.zero, b.pp, edp, training, self.layer_local)
            w, g, o = where(has_e, w + we, w), where(has_e, g + ge, g), where(has_e, o + oe, o)
        w = where(b.a2a == A2A_DUALPIPE, w * 2, w)
        later = b.zeros()
        if any_(self.lazy):
            lazy = self._lazy_one if b.one else self._lazy
            acts, buffers, g, later = lazy(layer_count, output, acts, buffers, g, name)
        live = w + g + o + acts + buffers
        other = params.runtime_overhead_gib * GiB + params.allocator_fragmentation * live
        return w, g, o, acts, buffers, other, later

    def _lazy_one(
        self, layer_count: int, output: bool, acts: float, buffers: float, g: float, name: str
    ) -> tuple[float, float, float, float]:
        """``_lazy`` for one plan: the schedule's point where activations, gradients and the
        logits together peak."""
        b = self.b
        p, v = b.pp, b.vpp
        points = lazy_grad_points(p, v, self.m, p - 1 if name == "last" else 0)
        if len(points) == 1 and points[0][1:] == (v, 1):
            return acts, buffers, g, 0.0
        count = layer_count if name == "last" else self.resident
        acts_count = self.act_layer * count
        sizes = _lazy_sizes(self, p, v, g, self.layer_local, acts_count, output, buffers)
        best = max(points, key=lambda pt: _score(pt, *sizes[1:]))
        return _at_peak(best, self.working, *sizes, buffers, g)

    def _lazy(
        self,
        layer_count: np.ndarray,
        output: bool,
        acts: np.ndarray,
        buffers: np.ndarray,
        g: np.ndarray,
        name: str,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """FSDP2 creates gradients at backward time: the optimizer's zero_grad (set to None)
        frees them before each step's first forward, and a chunk's gradient (under PP the
        unsharded fp32 accumulator, autograd's .grad upcast by FSDP2; without PP the
        reduce-scattered shard) appears at that chunk's first backward, while backwards free
        activations. The peak is the schedule's highest sum of the two (``lazy_grad_points``),
        not the sum of their highs; the output layer's logits and loss buffers (and, without
        PP, the embedding's output) live only while a micro-batch sits between its last chunk's
        forward and backward. Over arrays: each distinct (p, v, m) schedule walked once."""
        b = self.b
        acts, buffers, g = acts.astype(float), buffers.astype(float), g.astype(float)
        later = np.zeros(len(b))
        idx = self.lazy_idx
        p, v, m = b.pp[idx], b.vpp[idx], self.m[idx]
        one, inv = self.lazy_groups
        rank = (p - 1) if name == "last" else np.zeros(len(idx), dtype=np.int64)
        groups = [lazy_grad_points(int(p[i]), int(v[i]), int(m[i]), int(rank[i])) for i in one]
        # (groups x points x 3), padded with points that never win
        width = max(len(pts) for pts in groups)
        table = np.zeros((len(groups), width, 3), dtype=np.int64)
        valid = np.zeros((len(groups), width), dtype=bool)
        trivial = np.zeros(len(groups), dtype=bool)
        for j, pts in enumerate(groups):
            table[j, : len(pts)], valid[j, : len(pts)] = pts, True
            # one point with every gradient and the logits live is the plain sum: nothing to do
            trivial[j] = len(pts) == 1 and pts[0][1:] == (int(v[one[j]]), 1)
        keep = ~trivial[inv]
        sel, inv = idx[keep], inv[keep]
        count = layer_count[sel] if name == "last" else self.resident[sel]
        acts_count = self.act_layer[sel] * count
        layer_local = self.layer_local[sel]
        bs, gs = buffers[sel], g[sel]
        sizes = _lazy_sizes(self, b.pp[sel], b.vpp[sel], gs, layer_local, acts_count, output, bs)
        pts = table[inv].transpose(2, 0, 1)  # 3 x plans x points
        scores = _score(pts, *(x[:, None] for x in sizes[1:]))
        scores = np.where(valid[inv], scores, -np.inf)
        best = pts[:, np.arange(len(sel)), np.argmax(scores, axis=1)]
        parts = _at_peak(best, self.working[sel], *sizes, bs, gs)
        acts[sel], buffers[sel], g[sel], later[sel] = parts
        return acts, buffers, g, later


def _sum(parts: tuple[Any, ...]) -> Any:
    """A stage's total: weights + gradients + optimizer + activations + buffers + other."""
    w, g, o, acts, buffers, other, _ = parts
    return w + g + o + acts + buffers + other


def _score(pt: Any, chunk_acts: Any, chunk_grads: Any, transient: Any) -> Any:
    """Bytes live at a (chunks of activations held, chunks of gradients made, logits live)
    point of the schedule."""
    return pt[0] * chunk_acts + pt[1] * chunk_grads + pt[2] * transient


def _at_peak(
    pt: Any,
    working: Any,
    lazy: Any,
    chunk_acts: Any,
    chunk_grads: Any,
    transient: Any,
    buffers: Any,
    g: Any,
) -> tuple[Any, Any, Any, Any]:
    """(activations, buffers, gradients, gradients made after the peak) at the peak point."""
    held, made, tail = pt[0], pt[1], pt[2]
    later = lazy - made * chunk_grads
    return held * chunk_acts + working, buffers - transient * (1 - tail), g - later, later


def _lazy_sizes(
    t: MemoryTerms,
    pp: Any,
    vpp: Any,
    g: Any,
    layer_local: Any,
    acts_count: Any,
    output: bool,
    buffers: Any,
) -> tuple[Any, Any, Any, Any]:
    """(gradients created lazily, one chunk's activations, one chunk's gradients, the logits
    buffers, live only between a last chunk's forward and backward) of a stage whose layers
    keep ``acts_count`` activation bytes. Without PP one layer's unsharded gradient stays on its
    way to the reduce-scatter."""
    gbytes = DTYPE_BYTES[t.training.grad_reduce_dtype]
    lazy = where(pp > 1, g, g - gbytes * layer_local)
    transient = buffers if output else 0.0 * buffers
    return lazy, acts_count / vpp, lazy / vpp, transient


def memory_breakdown(
    model: ModelSpec,
    cluster: ClusterSpec,
    plan: ParallelPlan,
    training: TrainingSpec,
    params: ModelParams = DEFAULT_PARAMS,
) -> MemoryBreakdown:
    """Memory of the most loaded GPU (first or last pipeline stage): the memory terms of
    batch_memory.py (which the search runs over arrays of plans) on this one plan."""
    del cluster  # the memory model is independent of the interconnect
    act_layer = activation_bytes_per_layer(model, plan, training)
    act_none = act_layer
    if plan.recompute in ("full", "op"):  # the working set of a layer being recomputed
        act_none = activation_bytes_per_layer(model, plan, training, recompute="none")
    terms = MemoryTerms(model, training, params, PlanBatch.of(plan), act_layer, act_none)
    return terms.breakdown()
