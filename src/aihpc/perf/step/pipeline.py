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

The functions take one plan's numbers or numpy arrays of plans (numeric.py).
"""

from __future__ import annotations

from typing import Any

from aihpc.perf.step.numeric import maximum, where

__all__ = ["bubble_slots", "dualpipe_bubble_slots", "p2p_transfers", "zero_bubble_fraction"]


def dualpipe_bubble_slots(pp: Any, fwd_s: Any, bwd_s: Any, bwd_weight_s: Any) -> Any:
    """DualPipe's bubble in micro-batch slots (F + B) of a stage: (PP/2 - 1)(F&B + B - 3W)
    (DeepSeek-V3 technical report, arXiv 2412.19437, Table 2), where B is the whole backward,
    W its weight-gradient part and F&B an overlapped forward-and-backward pair, priced as
    F + B (its all-to-all hidden)."""
    slot = fwd_s + bwd_s
    ok = (pp >= 2) & (slot > 0)
    safe = where(slot > 0, slot, 1.0)
    return where(ok, (pp / 2 - 1) * maximum(0.0, fwd_s + 2 * bwd_s - 3 * bwd_weight_s) / safe, 0.0)


def zero_bubble_fraction(fwd_s: Any, bwd_input_s: Any, bwd_weight_s: Any) -> Any:
    """(F + B - 2W) / (F + B + W), at least 0: the part of a slot ZB-V cannot fill with W."""
    total = fwd_s + bwd_input_s + bwd_weight_s
    safe = where(total > 0, total, 1.0)
    return where(total <= 0, 0.0, maximum(0.0, fwd_s + bwd_input_s - 2 * bwd_weight_s) / safe)


def bubble_slots(pp: Any, vpp: Any, schedule: str = "1f1b", zb_fraction: Any = 0.0) -> Any:
    """Idle micro-batch slots (each one forward + backward of a stage) per step.
    ``zb_fraction``: ``zero_bubble_fraction`` of the stage, for ``schedule = "zbv"``."""
    slots = (pp - 1) / 2 * zb_fraction if schedule == "zbv" else (pp - 1) / vpp
    return where(pp <= 1, 0.0, slots)


def p2p_transfers(pp: Any, vpp: Any, num_microbatches: Any) -> Any:
    """Point-to-point sends on the critical path of one step (activations forward, gradients
    backward): one per micro-batch slot of the schedule per direction, v times as many chunks
    with interleaving, of which a stage waits on those of the fill and drain."""
    return where(pp <= 1, 0.0, 2.0 * (num_microbatches + (pp - 1) * vpp))
