"""Our own communication operators (torch only): MoE token dispatch / combine, ring attention.

* ``aihpc.comm.route``: one sparse all-to-all-v step (token permutation, the count exchange,
  packed uneven ``all_to_all_single``) and its adjoint, autograd-aware.
* ``aihpc.comm.moe_dispatch``: expert-parallel dispatch and combine over an EP group, flat or
  hierarchical (across nodes once per node, then inside the node, as DeepEP's normal kernels).
* ``aihpc.comm.ring``: context-parallel causal attention, K/V (and in the backward the dK/dV
  accumulators) passed around the CP group's ring, with the load-balanced token layout.
"""

from aihpc.comm.moe_dispatch import (
    Dispatched,
    DispatchHandle,
    EPGroups,
    MoEDispatcher,
    build_ep_groups,
)
from aihpc.comm.ring import load_balanced_layout, load_balanced_positions, ring_attention
from aihpc.comm.route import Route, combine_stage, dispatch_stage, plan_route

__all__ = [
    "DispatchHandle",
    "Dispatched",
    "EPGroups",
    "MoEDispatcher",
    "Route",
    "build_ep_groups",
    "combine_stage",
    "dispatch_stage",
    "load_balanced_layout",
    "load_balanced_positions",
    "plan_route",
    "ring_attention",
]
