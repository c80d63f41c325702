"""How an RL trainer cuts a step's samples into micro-batches for the update and for the
forward-only (log-prob) passes: NeMo-RL's two ways (nemo_rl/distributed/batched_data_dict.py,
``shard_by_batch_size``; the Megatron policy worker's ``train`` and ``get_logprobs``).

- ``packed`` (``policy.sequence_packing.enabled``, NeMo-RL's default since v0.3.0 and every
  performance recipe's but v0.3's Qwen3-30B-A3B): each sequence (prompt + response) is padded
  to a multiple of the tensor-parallel size (2 x cp x tp under context parallelism), the
  optimizer step's sequences are packed first-fit decreasing into bins of
  ``mbs x max_total_sequence_length`` tokens (the prompt plus the longest response), and the
  bins go round-robin to the data-parallel ranks: one bin is one micro-batch, so the busiest
  rank runs ceil(bins / dp) of them. Attention stays within each sequence (THD layout with
  cu_seqlens), so a bin costs its tokens in the GEMMs and the sum of its squared lengths in
  attention. With pipeline parallelism every micro-batch is padded to the longest bin (a static
  buffer between stages) unless ``rl.variable_seq_lengths`` (Megatron's flag, which verl and
  slime always set: the stages exchange each micro-batch's shape).
- ``padded`` (no packing, no dynamic batching): every sequence is padded to the longest of the
  whole batch and micro-batches hold ``mbs`` of them; attention runs over the padded length.
- ``unpadded`` (verl's Megatron actor with ``use_dynamic_bsz`` false, verl's default): each
  micro-batch holds ``mbs`` sequences (``ppo_micro_batch_size_per_gpu``) whatever their
  lengths, and the actor removes their padding before the model (it packs the micro-batch's
  sequences, THD with cu_seqlens), so a micro-batch costs its sequences' own tokens, many
  small micro-batches where dynamic batching makes few full ones. With pipeline parallelism
  and static shapes every micro-batch is priced at ``mbs`` of the longest sequence.

The step model (perf/step) prices micro-batches of ``mbs`` sequences of ``seq_length`` tokens;
a packed bin of T tokens is priced as T / s equal sequences of the attention-equivalent length
s = sum L^2 / sum L, which keeps both its GEMM tokens and its attention FLOPs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from aihpc.perf.rl.rollout import length_dist
from aihpc.runspec.errors import SpecError
from aihpc.runspec.parallel import ParallelPlan
from aihpc.runspec.rl import BATCHINGS, RLSpec

__all__ = [
    "Batches",
    "batches",
    "first_fit_decreasing",
    "pad_unit",
    "sequence_lengths",
]


@dataclass(frozen=True)
class Batches:
    """One pass over some samples as the step model prices it."""

    seq: int  # tokens of one priced sequence
    mbs: int  # priced sequences per micro-batch (seq x mbs: a micro-batch's tokens)
    microbatches: int  # on the busiest data-parallel rank
    useful: float  # the share of the computed tokens that are samples' (not padding)

    def global_batch(self, dp: int) -> int:
        """The priced sequences of one pass over every data-parallel rank."""
        return self.microbatches * dp * self.mbs


def pad_unit(plan: ParallelPlan) -> int:
    """The multiple each packed sequence is padded to: tp, or 2 x cp x tp with context
    parallelism (each of the 2 x cp load-balanced chunks split over the tp ranks)."""
    return 2 * plan.cp * plan.tp if plan.cp > 1 else plan.tp


def sequence_lengths(rl: RLSpec, n: int, unit: int = 1) -> np.ndarray:
    """``n`` samples' lengths (prompt + response at the response distribution's quantiles),
    each rounded up to a multiple of ``unit``."""
    raw = rl.prompt_len + length_dist(rl).quantiles(n)
    return np.ceil(raw / unit) * unit


def first_fit_decreasing(lengths: np.ndarray, capacity: float) -> list[float]:
    """The tokens of each bin when ``lengths`` are packed first-fit decreasing into bins of
    ``capacity`` (a sequence longer than a bin gets one of its own).

    Exact first fit in O(n log n): a max tree over the bins' free room finds the leftmost
    bin with room for each sequence (a step has thousands of sequences)."""
    items = sorted((float(x) for x in lengths), reverse=True)
    size = 1
    while size < max(1, len(items)):
        size *= 2
    room = [-1.0] * (2 * size)  # leaves: free room of bin i (-1: not opened yet)
    used: list[float] = []
    for length in items:
        if room[1] >= length:
            node = 1
            while node < size:  # descend to the leftmost leaf with room >= length
                node = 2 * node if room[2 * node] >= length else 2 * node + 1
            i = node - size
            used[i] += length
        else:
            i = len(used)
            used.append(length)
            node = size + i
        room[node] = capacity - used[i]
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return used


def _static(rl: RLSpec, plan: ParallelPlan) -> bool:
    """Pipeline stages exchange one fixed shape, so every micro-batch is padded to the step's
    longest (NeMo-RL); not with Megatron's ``variable_seq_lengths`` (verl, slime)."""
    return plan.pp > 1 and not rl.variable_seq_lengths


def _round_up(x: float, unit: int) -> int:
    """``x`` up to a whole multiple of ``unit`` (the step model splits a sequence evenly over
    the 2 x cp context chunks and the tp sequence-parallel ranks)."""
    return math.ceil(x / unit) * unit


def _packed(rl: RLSpec, plan: ParallelPlan, samples: int, mbs: int) -> Batches:
    lengths = sequence_lengths(rl, samples, pad_unit(plan))
    capacity = mbs * (rl.prompt_len + rl.response_cap)
    bins = first_fit_decreasing(lengths, capacity)
    per_rank = math.ceil(len(bins) / plan.dp)
    # pipeline with static shapes: every micro-batch padded to the longest bin; else each as
    # full as the mean
    tokens = max(bins) if _static(rl, plan) else sum(bins) / len(bins)
    attention_len = float(np.sum(lengths**2) / np.sum(lengths))
    per_mb = max(1, round(tokens / attention_len))
    seq = _round_up(tokens / per_mb, 2 * plan.cp * plan.tp)
    useful = float(np.sum(lengths)) / (tokens * len(bins))
    return Batches(seq=seq, mbs=per_mb, microbatches=per_rank, useful=min(1.0, useful))


def _padded(rl: RLSpec, plan: ParallelPlan, samples: int, mbs: int) -> Batches:
    unit = pad_unit(plan)
    longest = rl.prompt_len + length_dist(rl).longest(samples)
    seq = _round_up(longest, 2 * plan.cp * plan.tp if plan.cp > 1 else unit)
    per_rank = math.ceil(samples / (plan.dp * mbs))
    mean = rl.prompt_len + rl.response_len
    return Batches(seq=seq, mbs=mbs, microbatches=per_rank, useful=min(1.0, mean / seq))


def _unpadded(rl: RLSpec, plan: ParallelPlan, samples: int, mbs: int) -> Batches:
    lengths = sequence_lengths(rl, samples, pad_unit(plan))
    per_rank = math.ceil(samples / (plan.dp * mbs))
    # pipeline with static shapes: each micro-batch priced at mbs of the longest; else at mbs
    # of the mean
    tokens = mbs * float(np.max(lengths) if _static(rl, plan) else np.mean(lengths))
    attention_len = float(np.sum(lengths**2) / np.sum(lengths))
    per_mb = max(1, round(tokens / attention_len))
    seq = _round_up(tokens / per_mb, 2 * plan.cp * plan.tp)
    useful = float(np.mean(lengths)) * mbs / (seq * per_mb)
    return Batches(seq=seq, mbs=per_mb, microbatches=per_rank, useful=min(1.0, useful))


def batches(
    rl: RLSpec, plan: ParallelPlan, samples: int, how: str = "packed", mbs: int | None = None
) -> Batches:
    """``samples`` sequences of the step cut into micro-batches of ``mbs`` (default: the plan's
    micro_batch_size) as ``how`` says (runspec.rl.BATCHINGS)."""
    if how not in BATCHINGS:
        raise SpecError("rl batching", how, "one of " + ", ".join(BATCHINGS))
    mbs = mbs or plan.micro_batch_size
    if samples < 1:
        raise SpecError("rl samples", samples, "at least one sample to batch")
    cut = {"packed": _packed, "padded": _padded, "unpadded": _unpadded}[how]
    return cut(rl, plan, samples, mbs)
