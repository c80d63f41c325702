"""What a step of a vision-language run carries: samples per sequence, the language model's
sequence length, and the encoder seconds of a sample, a micro-batch and a data-parallel rank as
distributions (perf/multimodal/imbalance.py).

Packed: samples fill sequences of ``model.seq_length`` (floor(seq / mean sample tokens), at
least one), so the language model is balanced and the images per sequence vary with the samples.
Unpacked: one sample a sequence, padded to the longest of its micro-batch (at most
seq_length), and a step waits for its slowest data-parallel rank: where the ranks meet at every
micro-step (ZeRO-3 / FSDP gather every layer's weights in every micro-step, and a step of one
micro-step ends in its gradient collective) each micro-step runs as long as the rank whose
micro-batch holds the longest of the ``ranks x micro_batch`` samples drawn for it, so the
language model is priced at the expected maximum of ``ranks x micro_batch`` lengths; where they
meet once a step (DDP accumulating without a collective), at the expected maximum over ranks of
each rank's sum of ``micro_steps`` padded micro-batches. ``grouped`` is LLaVA's
group_by_modality_length sampler (llava/train/llava_trainer.py, haotian-liu/LLaVA at c121f04):
it draws a megabatch of ``ranks x micro_steps x micro_batch`` samples, sorts it longest first
and deals it greedily into ``ranks x micro_steps`` chunks (split_to_even_chunks: each sample to
the chunk of least total length), so chunk c opens with the (c+1)-th longest sample, and
micro-step k's ranks take chunks k x ranks ... k x ranks + ranks - 1: the rank holding chunk
k x ranks pads its micro-batch to the (k x ranks + 1)-th longest of the megabatch, and the
micro-steps are priced at the mean of those order statistics.
A cross-attention model (Llama 3.2 Vision) keeps image tokens out of its sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from aihpc.perf.multimodal.encoder import EncoderRates, ImageWork, encoder_rates, image_work
from aihpc.perf.multimodal.imbalance import (
    Grid,
    compound,
    expected_max,
    expected_order_stat,
    max_of,
)
from aihpc.perf.step.params import ModelParams
from aihpc.runspec.cluster import ClusterSpec
from aihpc.runspec.model import ModelSpec
from aihpc.runspec.training import TrainingSpec
from aihpc.runspec.vision import MultimodalSpec, VisionSpec

__all__ = [
    "Layout",
    "image_works",
    "layout",
    "mean_works",
    "padded_length",
    "rates_for",
    "sample_cost",
    "sample_lengths",
]


@dataclass(frozen=True)
class Layout:
    samples_per_seq: int
    llm_seq: int  # the language model's sequence length priced
    packed: bool


def image_works(v: VisionSpec, mm: MultimodalSpec) -> list[tuple[ImageWork, float]]:
    """Each image size of the data fact as its work, with its probability (sizes capped at
    what the encoder takes: max_tiles tiles, max_pixels pixels)."""
    cap = v.max_image_tokens or math.inf
    d = mm.image_tokens
    return [
        (image_work(v, min(t, cap)), w) for t, w in zip(d.values, d.weights, strict=True) if w > 0
    ]


def mean_works(works: list[tuple[ImageWork, float]]) -> ImageWork:
    """The mean image (patches, pairs, tokens; the call length weighted by patches)."""
    p = sum(w.patches * q for w, q in works)
    return ImageWork(
        patches=p,
        pairs=sum(w.pairs * q for w, q in works),
        lm_tokens=sum(w.lm_tokens * q for w, q in works),
        call_keys=sum(w.call_keys * w.patches * q for w, q in works) / max(p, 1e-9),
    )


def sample_lengths(v: VisionSpec, mm: MultimodalSpec) -> Grid:
    """Language-model tokens of one sample: its text and (unless the model cross-attends to
    them) its images' tokens."""
    text = Grid.of_dist(mm.text_tokens)
    if v.cross_attention_layers:
        return text
    works = image_works(v, mm)
    img = Grid.of([w.lm_tokens for w, _ in works], [q for _, q in works])
    return text.add(compound(mm.images_per_sample, img))


def layout(
    model: ModelSpec,
    v: VisionSpec,
    mm: MultimodalSpec,
    micro_batch: int,
    ranks: int = 1,
    micro_steps: int = 1,
    synced: bool = True,
) -> Layout:
    """The language model's sequence: packed, fixed (``max``), or the padded length a step's
    micro-steps wait for (the module's docstring), each sample capped at ``seq_length``."""
    lengths = sample_lengths(v, mm)
    if mm.packing:
        k = max(1, int(model.seq_length // max(lengths.mean, 1.0)))
        return Layout(k, model.seq_length, True)
    if mm.padding == "max":
        return Layout(1, model.seq_length, False)
    capped = lengths.map(lambda x: np.minimum(x, model.seq_length))
    padded = padded_length(capped, micro_batch, ranks, micro_steps, synced, mm.padding)
    return Layout(1, max(1, min(model.seq_length, math.ceil(padded))), False)


def padded_length(
    lengths: Grid, micro_batch: int, ranks: int, micro_steps: int, synced: bool, padding: str
) -> float:
    """Mean padded length of a step's micro-steps on its slowest rank (module docstring)."""
    b, d, m = max(1, micro_batch), max(1, ranks), max(1, micro_steps)
    if padding == "grouped":
        n = d * m * b
        return sum(expected_order_stat(lengths, n, k * d + 1) for k in range(m)) / m
    if synced or m == 1:
        return expected_max(lengths, d * b)
    return expected_max(max_of(lengths, b).times(m), d) / m


def rates_for(
    v: VisionSpec,
    model: ModelSpec,
    mm: MultimodalSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    params: ModelParams,
    tp: int,
    samples: float,
) -> EncoderRates:
    """The encoder's rates split ``tp`` ways when ``samples`` samples share a micro-batch."""
    mean = mean_works(image_works(v, mm))
    images = max(mm.images_per_sample.mean * samples, 1e-9)
    return encoder_rates(
        v,
        model.hidden_size,
        cluster,
        training,
        params,
        tp,
        mean.patches * images,
        mean.call_keys,
        mean.lm_tokens * images,
        mm.encoder_recompute == "full",
    )


def sample_cost(
    v: VisionSpec, mm: MultimodalSpec, rates: EncoderRates, trained: bool, projector: bool
) -> Grid:
    """Encoder + projector seconds of one sample (its images' sum) on one GPU."""
    works = image_works(v, mm)
    costs = [rates.image_s(w, trained, projector) for w, _ in works]
    img = Grid.of(costs, [q for _, q in works])
    return compound(mm.images_per_sample, img)
