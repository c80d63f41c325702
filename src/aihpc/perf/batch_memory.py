"""``memory_breakdown`` over arrays of plans: the most loaded stage's total and what is offloaded,
with the same arithmetic (weights, gradients and optimizer state by ZeRO stage; activations in
flight under 1F1B, interleaving and ZB-V; FSDP2's lazily created gradients; runtime overhead).
"""

from __future__ import annotations

import numpy as np

from aihpc.perf.batch_shapes import Shapes
from aihpc.perf.flops import embedding_params
from aihpc.perf.memory import DTYPE_BYTES, MOMENTS, GiB, largest_param_tensor, lazy_grad_points
from aihpc.perf.params import ModelParams
from aihpc.perf.plan_batch import A2A_DUALPIPE, FULL, OP, PlanBatch, group, layer_params_split
from aihpc.spec.model import ModelSpec
from aihpc.spec.training import TrainingSpec

__all__ = ["memory_total"]


def _state_bytes(
    params_local: np.ndarray,
    zero: np.ndarray,
    pp: np.ndarray,
    d: np.ndarray,
    training: TrainingSpec,
    layer_local: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """memory._state_bytes over arrays (``d``: the ranks sharing the states)."""
    g, o = DTYPE_BYTES[training.grad_reduce_dtype], DTYPE_BYTES[training.optimizer_dtype]
    moments = MOMENTS[training.optimizer]
    fp8_cache = 1.0 if training.precision == "fp8" else 0.0
    z3, keeps = zero == 3, (zero == 3) & (pp > 1)
    w3 = o * params_local / d + np.where(
        keeps, (2 + fp8_cache) * params_local, (2 + fp8_cache) * 2 * layer_local
    )
    g3 = g * params_local / d + np.where(keeps, g * params_local, g * layer_local)
    o3 = moments * o * params_local / d
    w = (2 + fp8_cache) * params_local
    gr = g * params_local / np.where(zero == 2, d, 1)
    op = (1 + moments) * o * params_local / np.where(zero >= 1, d, 1)
    return np.where(z3, w3, w), np.where(z3, g3, gr), np.where(z3, o3, op)


def memory_total(
    model: ModelSpec,
    training: TrainingSpec,
    params: ModelParams,
    b: PlanBatch,
    sh: Shapes,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(memory_breakdown(...).total, .offloaded, activation bytes per layer) over arrays."""
    return MemoryTerms(model, training, params, b, sh).total()


class MemoryTerms:
    """memory.memory_breakdown over arrays: the most loaded stage's total and what is offloaded."""

    def __init__(
        self,
        model: ModelSpec,
        training: TrainingSpec,
        params: ModelParams,
        b: PlanBatch,
        sh: Shapes,
    ) -> None:
        self.model, self.training, self.params, self.b = model, training, params, b
        p, v = b.pp, b.vpp
        self.m = m = b.global_batch_size // (b.dp * b.mbs)
        self.lps = -(-model.num_layers // (p * v)) * v
        one_dense, one_exp = layer_params_split(model, np.ones(len(b), np.int64), b.tp, b.etp, b.ep)
        self.layer_local = np.where(one_exp != 0, one_dense + one_exp, one_dense)
        if training.zero3_gather == "per_tensor":
            self.layer_local = largest_param_tensor(model) / b.tp
        self.emb_local = embedding_params(model) / b.tp
        tokens = b.mbs * model.seq_length / b.cp
        self.act_layer = act = sh.by_rec(sh.act, b.rec)
        none = sh.act_none[sh.inv]
        self.working = np.where((b.rec == FULL) | (b.rec == OP), np.maximum(0.0, none - act), 0.0)
        mb = np.minimum(p, m)
        self.zbv_acts = act * self.lps * mb + self.working
        in_flight = np.where(
            v > 1, np.minimum(m, (np.minimum(2 * (p - 1) + (v - 1) * p, m * v) + 1) / v), mb
        )
        last_in_flight = np.where(v > 1, np.minimum(m, (np.minimum((v - 1) * p, m * v) + 1) / v), 1)
        off = b.offload
        self.resident = np.where(
            off > 0, np.maximum(self.lps - off, np.minimum(self.lps, 2)), self.lps
        )
        self.offloaded = np.where(off > 0, off, 0)
        self.first_acts = act * self.resident * in_flight + self.working
        self.last_acts = act * self.lps * last_in_flight + self.working
        loss_bytes = 14 if training.cross_entropy == "eager" else 6
        self.logits = tokens * (loss_bytes * model.vocab_size / b.tp + 4 * model.hidden_size)
        self.embed_out = (
            tokens * model.hidden_size * 2 * np.where(p > 1, mb, 1) / np.where(b.sp, b.tp, 1)
        )
        self.lazy = (b.zero == 3) & (training.zero3_gather == "bucketed") & (b.pp_schedule != "zbv")
        self.lazy_idx = np.nonzero(self.lazy)[0]
        i = self.lazy_idx
        self.lazy_groups = group(p[i], v[i], m[i]) if len(i) else (i, i)

    def total(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        b, model = self.b, self.model
        single = b.pp == 1
        zbv = b.pp_schedule == "zbv"
        n = len(b)
        both = self.logits + self.embed_out
        only = self.stage(np.full(n, model.num_layers), True, True, self.first_acts, both, "only")
        if zbv:
            multi = self.stage(self.lps, True, True, self.zbv_acts, both, "first")
        else:
            first = self.stage(self.lps, True, False, self.first_acts, self.embed_out, "first")
            last = self.stage(self.lps, False, True, self.last_acts, self.logits, "last")
            multi = np.where(first >= last, first, last)
        total = np.where(single, only, multi)
        return total, self.act_layer * self.offloaded, self.act_layer

    def stage(
        self,
        layer_count: np.ndarray,
        embed: bool,
        output: bool,
        acts: np.ndarray,
        buffers: np.ndarray,
        name: str,
    ) -> np.ndarray:
        b, model, training, params = self.b, self.model, self.training, self.params
        params_local, expert_local = layer_params_split(model, layer_count, b.tp, b.etp, b.ep)
        if embed:
            params_local = params_local + self.emb_local
        if output and (not model.tied_embeddings or not embed):
            params_local = params_local + self.emb_local
        d = (b.dp_shard or b.dp) * b.cp
        w, g, o = _state_bytes(params_local, b.zero, b.pp, d, training, self.layer_local)
        has_e = expert_local != 0
        if has_e.any():
            edp = np.maximum(1, b.tp * b.cp * b.dp // (b.etp * b.ep))
            we, ge, oe = _state_bytes(expert_local, b.zero, b.pp, edp, training, self.layer_local)
            w, g, o = (
                np.where(has_e, w + we, w),
                np.where(has_e, g + ge, g),
                np.where(has_e, o + oe, o),
            )
        w = np.where(b.a2a == A2A_DUALPIPE, w * 2, w)
        if self.lazy.any():
            acts, buffers, g = self._lazy(layer_count, output, acts, buffers, g, name)
        live = w + g + o + acts + buffers
        other = params.runtime_overhead_gib * GiB + params.allocator_fragmentation * live
        return w + g + o + acts + buffers + other

    def _lazy(
        self,
        layer_count: np.ndarray,
        output: bool,
        acts: np.ndarray,
        buffers: np.ndarray,
        g: np.ndarray,
        name: str,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """FSDP2's gradients appear at their chunk's first backward: the schedule's peak."""
        b = self.b
        acts, buffers, g = acts.astype(float), buffers.astype(float), g.astype(float)
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
        vj = b.vpp[sel]
        gs = g[sel]
        gbytes = DTYPE_BYTES[self.training.grad_reduce_dtype]
        lazy = np.where(b.pp[sel] > 1, gs, gs - gbytes * self.layer_local[sel])
        count = layer_count[sel] if name == "last" else self.resident[sel]
        chunk_acts = self.act_layer[sel] * count / vj
        chunk_grads = lazy / vj
        transient = buffers[sel] if output else np.zeros(len(sel))
        pts = table[inv]  # plans x points x 3
        scores = (
            pts[:, :, 0] * chunk_acts[:, None]
            + pts[:, :, 1] * chunk_grads[:, None]
            + pts[:, :, 2] * transient[:, None]
        )
        scores = np.where(valid[inv], scores, -np.inf)
        best = pts[np.arange(len(sel)), np.argmax(scores, axis=1)]
        held, made, tail = best[:, 0], best[:, 1], best[:, 2]
        acts[sel] = held * chunk_acts + self.working[sel]
        buffers[sel] = buffers[sel] - transient * (1 - tail)
        g[sel] = gs - (lazy - made * chunk_grads)
        return acts, buffers, g
