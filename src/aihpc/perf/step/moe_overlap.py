"""What Megatron-Core's 1F1B A2A overlap leaves exposed of one MoE layer's all-to-alls, seconds.

Megatron-Core's combined 1F1B (``--overlap-moe-expert-parallel-comm``, Megatron-Bridge's
``moe_a2a_overlap`` 1f1b) runs one micro-batch's forward of a layer beside another's backward of
a layer, the transfers on a communication stream and the compute on the compute stream, in the
order ``TransformerLayerSchedulePlan.run`` issues them (megatron/core/models/common/
model_chunk_schedule_plan.py; the docstring's diagram)::

    comm_stream: combine_bwd | dispatch_fwd -> dispatch_bwd   | combine_fwd
    comp_stream: attn_fwd    | mlp_bwd -> mlp_bwd_dw -> mlp_fwd | attn_bwd

Each transfer hides behind the one sub-module it is paired with, not behind the whole layer:
the backward's combine behind the forward's attention side (attention, norm, router, dispatch
preprocessing), the forward's dispatch behind the backward's MoE block (its data and weight
gradients), the backward's dispatch behind the forward's MoE block (which needs the forward's
dispatch first), the forward's combine behind the backward's attention side (it needs the
forward's MoE block first). A transfer longer than its partner leaves the difference exposed;
with the dependencies above the pair of windows in the middle adds up the same way
(``max(d, m_b) + max(t_db, m_f) - m_b - m_f``). DualPipe is not priced here: it splits each
backward part into input and weight gradients, rearranges a chunk pair's parts and adjusts the
SMs given to communication so that the all-to-alls are "fully hidden during execution"
(DeepSeek-V3 report, arXiv 2412.19437, sec. 3.2.1, Figure 4); its transfers keep the whole
layer's compute as their window (``StepTerms.ep_comm``).

The backward moves the same bytes as the forward: the combine's gradient goes back as a
dispatch of the combine's size (16-bit), the dispatch's as a combine of 16-bit gradients.
Each partner hides ``overlap_efficiency`` of its length (the collective's SMs slow it), the
penalty every other overlapped collective of the model pays.
"""

from __future__ import annotations

from typing import Any

from aihpc.perf.step.numeric import maximum

__all__ = ["paired_exposed_s"]


def paired_exposed_s(
    dispatch: Any,
    combine: Any,
    attn_fwd: Any,
    attn_bwd: Any,
    mlp_fwd: Any,
    mlp_bwd: Any,
    efficiency: float,
) -> Any:
    """Exposed all-to-all seconds of one MoE layer's forward and backward transfers when its
    forward runs beside another micro-batch's backward of a layer (and vice versa), from the
    forward dispatch and combine times and the layer's attention-side and MoE-block compute.
    Works on numbers or on numpy arrays of plans alike."""
    grad = combine  # both backward transfers move 16-bit gradients of the combine's size
    windows = (
        (grad, attn_fwd),  # combine_bwd | attn_fwd
        (dispatch, mlp_bwd),  # dispatch_fwd | mlp_bwd (+ dw)
        (grad, mlp_fwd),  # dispatch_bwd | mlp_fwd
        (combine, attn_bwd),  # combine_fwd | attn_bwd
    )
    exposed = 0.0
    for transfer, partner in windows:
        exposed = exposed + maximum(0.0, transfer - efficiency * partner)
    return exposed
