"""Pipeline schedule: bubble of 1F1B and interleaved 1F1B (Narayanan et al. SC'21, §2.2).

1F1B: the bubble is (p - 1) micro-batch slots, a fraction (p - 1) / m of the ideal time.
Interleaved with v model chunks per rank: (p - 1) / v slots, at v times more point-to-point
transfers. With fewer micro-batches than stages (m < p) the pipeline never fills and the bubble
stays (p - 1) / v slots while the useful work shrinks to m slots.
"""

from __future__ import annotations

__all__ = ["bubble_slots", "p2p_transfers"]


def bubble_slots(pp: int, vpp: int) -> float:
    """Idle micro-batch slots (each one forward + backward of a stage) per step."""
    if pp <= 1:
        return 0.0
    return (pp - 1) / vpp


def p2p_transfers(pp: int, vpp: int, num_microbatches: int) -> float:
    """Point-to-point sends on the critical path of one step (activations forward, gradients
    backward): one per micro-batch slot of the schedule per direction, v times as many chunks
    with interleaving, of which a stage waits on those of the fill and drain."""
    if pp <= 1:
        return 0.0
    return 2.0 * (num_microbatches + (pp - 1) * vpp)
