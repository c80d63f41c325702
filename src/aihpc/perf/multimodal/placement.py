"""Where the encoder runs, and what each placement adds to the language model's step.

Every data-parallel rank carries m micro-batches a step; X_j is the encoder + projector seconds
of micro-batch j (a distribution: images per sample x tokens per image), S = X_1 + ... + X_m a
rank's, and the step waits for the slowest of the D ranks: E[max of D copies of S]
(perf/multimodal/imbalance.py). Terms (seconds a step):

- ``replicated``: on the first pipeline stage, the whole encoder on every TP rank (each encodes
  all of the micro-batch's images; no TP traffic, t x redundant work). Stage 0's micro-batch
  slot grows by X_j, so the step grows by E[max S]; with p > 1 stage 0 sets the pipeline's
  pace, and its (p - 1) / v slots of fill and drain grow by E[X] each.
- ``tp``: on the first stage, split with the language model's TP (Megatron-Core's and NeMo's
  default): X_j at the encoder's TP-t rates, plus two all-reduces per layer and direction.
- ``stage``: its own pipeline stage on e GPUs of each pipeline (Megatron-Core's
  ``encoder_pipeline_model_parallel_size = 1``, ``encoder_tensor_model_parallel_size = e``):
  the pipeline has p + 1 stages and runs at its slowest stage's pace, so a micro-batch costs
  max(X_j, t) where t is the language model's stage slot: the step grows by E[max over ranks of
  sum_j max(0, X_j - t)] plus one encoder slot of fill (E[X]). The language model keeps
  N - D e GPUs.
- ``pool``: a separate pool of G GPUs encodes the whole global batch, its images spread over
  them image by image (DistMM, DistTrain), overlapped with the language model one micro-batch
  ahead: step = max(T_llm, T_pool) + the first micro-batch's encoding and its embeddings'
  transfer, T_pool = E[max over the G GPUs of their images' seconds].
- ``bubble``: the encoder's layers spread over the p stages with the language model's TP, its
  forward and backward scheduled into the pipeline's bubbles (Optimus, ATC'24): what does not
  fit the bubble, E[max S] / p - bubble, is exposed, and the first micro-batch's forward
  (E[X_fwd] / p) precedes the pipeline's start. Needs p > 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from aihpc.perf.multimodal.imbalance import Grid, expected_max
from aihpc.perf.step.comm import p2p_time_s

__all__ = [
    "PlacementTerms",
    "embedding_transfer_s",
    "first_stage",
    "in_bubbles",
    "own_stage",
    "pool",
]


@dataclass(frozen=True)
class PlacementTerms:
    """Seconds a placement adds to the step: the mean encoder time on the critical path, the
    imbalance (expected maximum over ranks minus the mean), transfers and fill; for the pool,
    encoder + imbalance is what the pool's slowest GPU takes beyond the language model's step,
    so that step + encoder + imbalance = max(T_llm, T_pool)."""

    encoder: float
    imbalance: float
    fill: float = 0.0
    transfer: float = 0.0


def _rank(mb: Grid, m: int, ranks: int) -> tuple[float, float]:
    """(mean, expected maximum over ``ranks``) of a rank's sum of ``m`` micro-batches."""
    total = mb.times(m)
    return total.mean, expected_max(total, ranks)


def first_stage(mb: Grid, m: int, dp: int, bubble_slots: float = 0.0) -> PlacementTerms:
    """replicated / tp: the rank's encoder seconds join stage 0's critical path; with a
    pipeline, stage 0 is the slowest stage, so every stage's slot in the fill and drain grows by
    a micro-batch's encoder seconds too (``bubble_slots``: (p - 1) / v of them)."""
    mean, worst = _rank(mb, m, dp)
    return PlacementTerms(encoder=mean, imbalance=worst - mean, fill=bubble_slots * mb.mean)


def own_stage(mb: Grid, m: int, dp: int, slot_s: float) -> PlacementTerms:
    """stage: micro-batches slower than the language model's stage slot stall the pipeline."""
    excess = mb.map(lambda x: (x - slot_s).clip(min=0.0))
    mean, worst = _rank(excess, m, dp)
    return PlacementTerms(encoder=mean, imbalance=worst - mean, fill=mb.mean)


def pool(
    image_s: Grid,
    images_per_step: float,
    gpus: int,
    llm_step_s: float,
    first_mb_s: float,
    transfer_s: float,
) -> PlacementTerms:
    """pool: the step is the slower of the language model and the pool, plus the fill."""
    per_gpu = max(1, round(images_per_step / gpus))
    load = image_s.times(per_gpu)
    mean = load.mean * images_per_step / (per_gpu * gpus)  # the exact share of the images
    worst = expected_max(load, gpus) * images_per_step / (per_gpu * gpus)
    return PlacementTerms(
        encoder=max(0.0, mean - llm_step_s),
        imbalance=max(0.0, worst - max(mean, llm_step_s)),
        fill=first_mb_s,
        transfer=transfer_s,
    )


def in_bubbles(
    mb: Grid, mb_fwd_mean: float, m: int, dp: int, pp: int, bubble_s: float
) -> PlacementTerms:
    """bubble: the encoder's share per stage fills the bubble; the rest is exposed."""
    mean, worst = _rank(mb, m, dp)
    exposed_mean = max(0.0, mean / pp - bubble_s)
    exposed_worst = max(0.0, worst / pp - bubble_s)
    return PlacementTerms(
        encoder=exposed_mean, imbalance=exposed_worst - exposed_mean, fill=mb_fwd_mean / pp
    )


def embedding_transfer_s(cluster, lm_tokens: float, hidden: int, trained: bool) -> float:  # type: ignore[no-untyped-def]
    """One micro-batch's embeddings sent from the pool to the language model (and their
    gradients back when the encoder or projector learns), over the scale-out network."""
    one = p2p_time_s(cluster, 2.0 * lm_tokens * hidden, cross_domain=True)
    return one * (2 if trained else 1)
