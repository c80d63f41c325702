"""The order an eager MoE layer's forward is issued in around its host sync, in seconds.

A device-to-host sync stalls the queue: the host returns from it only once the GPU has run
everything queued before, so nothing issued after it overlaps anything issued before. From one
layer's sync to the next the host issues, in order, the MoE block (B: the expert-parallel
all-to-all, the experts, the combine, the unpermute) and then the next layer's attention side
(A: norms, attention, router, the dispatcher's preprocessing up to its sync). An in-order stream
started empty finishes that segment at the latest of, over every op, the host's time to issue
up to it plus the GPU's time from it to the end; for the two blocks::

    max(issue + g_B + g_A,   h_B + g_A,   h_B + h_A)

The middle term is what ``max(GPU, host)`` over the whole layer misses: the MoE block's host
time, where per-expert launches and small kernels make it the host-bound part, cannot hide
behind the attention side's kernels, which come after it in the stream. (The backward has no
sync and keeps ``max(GPU, host)``.)

The ops are moe_host.py's counts, split at the sync the dispatcher waits on (Megatron-LM
23265d2): the alltoall dispatcher's preprocessing, device-to-host copies and fused permute come
before its "before_ep_alltoall" sync, its all-to-alls, chunk sort, combine and unpermute after;
the flex dispatcher issues its views, routing map and fused dispatch before the sync inside
``dispatch_with_permute``, its combine and getters after. TEGroupedMLP, with its per-expert
launches, is after the sync in both.
"""

from __future__ import annotations

__all__ = ["SPLIT_DISPATCH_OPS", "sync_ordered_s"]

# The dispatcher's Python-issued ops (moe_host._DISPATCH_OPS) before / after its sync.
SPLIT_DISPATCH_OPS = {"alltoall": (19 + 12 + 2, 4 + 1 + 4 + 2 + 3), "hierarchical": (7 + 2, 1 + 2)}


def sync_ordered_s(
    gpu_attn: float, gpu_moe: float, host_attn: float, host_moe: float, syncs: int, issue_s: float
) -> float:
    """Seconds from one layer's sync to the next: the MoE block (``gpu_moe`` on the GPU,
    ``host_moe`` to issue) then the attention side, in one in-order stream started empty; the
    GPU idles ``issue_s`` after each of ``syncs`` host syncs until the first op is issued."""
    return max(syncs * issue_s + gpu_moe + gpu_attn, host_moe + gpu_attn, host_moe + host_attn)
