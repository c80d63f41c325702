"""Pipeline schedule: the bubble of 1F1B, interleaved 1F1B and the zero-bubble V schedule.

1F1B (Narayanan et al. SC'21, §2.2): the bubble is (p - 1) micro-batch slots, a fraction
(p - 1) / m of the ideal time. Interleaved with v model chunks per rank: (p - 1) / v slots, at v
times more point-to-point transfers. With fewer micro-batches than stages (m < p) the pipeline
never fills and the bubble stays (p - 1) / v slots while the useful work shrinks to m slots.

Zero-bubble V (ZB-V; Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, arXiv 2401.10241):
the backward is split into the input-gradient pass B and the weight-gradient pass W, which no
other stage waits for, so W fills the idle slots. The paper's Table 2 gives the bubble of its
handcrafted zero-bubble schedule as (p - 1)(T_F + T_B - 2 T_W) against 1F1B's
(p - 1)(T_F + T_B + T_W), and ZB-V reaches it at 1F1B's activation memory with two chunks per
rank placed in a V (their comparison: bubble 0 when T_F = T_B = T_W, pipeline traffic 2x 1F1B).
With the times of one chunk (half a stage) that is (p - 1)(F + B - 2W) / 2 for stage times F, B,
W; as micro-batch slots of F + B + W: (p - 1) / 2 x max(0, F + B - 2W) / (F + B + W).
"""

from __future__ import annotations

__all__ = ["bubble_slots", "dualpipe_bubble_slots", "p2p_transfers", "zero_bubble_fraction"]


def dualpipe_bubble_slots(pp: int, fwd_s: float, bwd_s: float, bwd_weight_s: float) -> float:
    """DualPipe's bubble in micro-batch slots (F + B) of a stage: (PP/2 - 1)(F&B + B - 3W)
    (DeepSeek-V3 technical report, arXiv 2412.19437, Table 2), where B is the whole backward,
    W its weight-gradient part and F&B an overlapped forward-and-backward pair, priced as
    F + B (its all-to-all hidden)."""
    slot = fwd_s + bwd_s
    if pp < 2 or slot <= 0:
        return 0.0
    return (pp / 2 - 1) * max(0.0, fwd_s + 2 * bwd_s - 3 * bwd_weight_s) / slot


def zero_bubble_fraction(fwd_s: float, bwd_input_s: float, bwd_weight_s: float) -> float:
    """(F + B - 2W) / (F + B + W), at least 0: the part of a slot ZB-V cannot fill with W."""
    total = fwd_s + bwd_input_s + bwd_weight_s
    if total <= 0:
        return 0.0
    return max(0.0, fwd_s + bwd_input_s - 2 * bwd_weight_s) / total


def bubble_slots(pp: int, vpp: int, schedule: str = "1f1b", zb_fraction: float = 0.0) -> float:
    """Idle micro-batch slots (each one forward + backward of a stage) per step.
    ``zb_fraction``: ``zero_bubble_fraction`` of the stage, for ``schedule = "zbv"``."""
    if pp <= 1:
        return 0.0
    if schedule == "zbv":
        return (pp - 1) / 2 * zb_fraction
    return (pp - 1) / vpp


def p2p_transfers(pp: int, vpp: int, num_microbatches: int) -> float:
    """Point-to-point sends on the critical path of one step (activations forward, gradients
    backward): one per micro-batch slot of the schedule per direction, v times as many chunks
    with interleaving, of which a stage waits on those of the fill and drain."""
    if pp <= 1:
        return 0.0
    return 2.0 * (num_microbatches + (pp - 1) * vpp)
