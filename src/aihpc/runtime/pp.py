"""Pipeline parallel with torch.distributed.pipelining: layer split, stages and schedules.

Schedules (``[parallel] pp_schedule``):

- ``1f1b``: one stage per rank, one forward then one backward in the steady state (PipeDream-
  Flush, Narayanan et al. SC'21 §2.2); bubble (p - 1) micro-batch slots.
- ``interleaved-1f1b``: ``vpp`` stages per rank in a loop (rank r holds stages r, r + p, ...);
  bubble (p - 1) / v slots (same paper, §2.2).
- ``zbv``: zero-bubble V schedule (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024,
  arXiv 2401.10241): two stages per rank in a V (rank r holds stages r and 2p - 1 - r), the
  backward split into input-gradient (B) and weight-gradient (W) passes, the W passes filling
  what would be the bubble; bubble 0 when forward, B and W take equal time, at 1F1B's activation
  memory and twice its point-to-point traffic.

Layers are split over the p x v stages contiguously: stage s holds L // S layers plus one if
s < L % S, so uneven splits (as the planner allows: the busiest rank holds ceil(L / S) per
stage) put the extra layers on the earliest stages. The first stage also holds the embedding and
the last the final norm and the output.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import torch
from torch import nn

from aihpc.runtime.mesh import ParallelDims
from aihpc.runtime.moe import loads_not_counted

__all__ = ["StageModule", "build_schedule", "stage_ids", "stage_layers"]


def stage_layers(num_layers: int, num_stages: int) -> list[list[int]]:
    """Layer indices of each stage, in order."""
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def stage_ids(dims: ParallelDims, pp_rank: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` holds, in the order its schedule expects."""
    p, v = dims.pp, dims.vpp
    if dims.pp_schedule == "zbv":
        return [pp_rank, 2 * p - 1 - pp_rank]
    return [pp_rank + i * p for i in range(v)]


class StageModule(nn.Module):
    """One pipeline stage: the embedding (first stage), some layers, the norm and output (last
    stage) of the rank's model, which it shares. Only the stage's own parts are submodules, so
    ``parameters()`` are the stage's (the zero-bubble weight pass needs exactly those)."""

    def __init__(self, model: nn.Module, layers: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layers})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self._model = [model]  # a list, so the model is not registered as a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: tokens (batch, seq) on the first stage, else activations (batch, seq, dim)."""
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        return self._model[0].run_layers(h, self.layers.values(), last=self.output is not None)


@cache
def _stage_class() -> type:
    """torch's ``PipelineStage`` whose metadata inference leaves the MoE routers' token counts
    alone.

    Given no shapes, torch 2.13 infers each stage's input / output metadata at the first step by
    running a real forward and backward of the stage once before the first micro-batch: on the
    first stage on a detached copy of micro-batch 0, on the others on ``torch.empty_strided``
    inputs (whatever the allocator hands back). It restores the RNG and drops the gradients
    (``_post_metadata_inference_cleanup``), not module state: a router would count micro-batch 0
    twice on the first stage and tokens of garbage on the others, and the routing-bias update
    after step 1 would depend on leftover memory, hence on timing and on what ran before.
    """
    from torch.distributed.pipelining import PipelineStage

    if not hasattr(PipelineStage, "_forward_metadata_inference"):
        raise RuntimeError(
            "torch.distributed.pipelining.PipelineStage has no _forward_metadata_inference: "
            "check that its metadata inference still leaves router loads uncounted"
        )

    class Stage(PipelineStage):
        def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            with loads_not_counted(self.submod):
                return super()._forward_metadata_inference(*args, **kwargs)

    return Stage


def build_schedule(
    stages: list[StageModule],
    ids: list[int],
    dims: ParallelDims,
    pp_group: Any,
    device: torch.device,
    num_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Any:
    """The schedule object that runs one step: ``schedule.step(x, target=y, losses=[])``."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleInterleaved1F1B,
        ScheduleZBVZeroBubble,
    )

    n = dims.pp * (2 if dims.pp_schedule == "zbv" else dims.vpp)
    pipeline = [
        _stage_class()(module, sid, n, device, group=pp_group)
        for module, sid in zip(stages, ids, strict=True)
    ]
    if dims.pp_schedule == "1f1b":
        return Schedule1F1B(pipeline[0], num_microbatches, loss_fn=loss_fn)
    cls = ScheduleZBVZeroBubble if dims.pp_schedule == "zbv" else ScheduleInterleaved1F1B
    return cls(pipeline, num_microbatches, loss_fn=loss_fn)
