"""A vision-language training job's setup (job.build's, for a spec with [model.vision]): the plan
laid out over the ranks with the VLM, its optimizer, schedule, the image-text data and the state
a checkpoint holds (the same mapping as a text job's)."""

from __future__ import annotations

from typing import Any

import torch

from aihpc.resilience import ModelOptimizerState, RNGState
from aihpc.runspec import RunSpec
from aihpc.runtime.config import LlamaConfig
from aihpc.runtime.data import load_tokens
from aihpc.runtime.distributed import DistContext
from aihpc.runtime.mesh import Parallel
from aihpc.runtime.pp import build_schedule
from aihpc.runtime.vlm.images import ImageTextLoader
from aihpc.runtime.vlm.parallel import build_vlm_model
from aihpc.runtime.vlm.step import VisionStepper, text_loss

__all__ = ["build_vlm"]


def build_vlm(
    spec: RunSpec,
    cfg: LlamaConfig,
    micro: int,
    accum: int,
    ctx: DistContext,
    par: Parallel,
    optimizer_for: Any,
) -> tuple[Any, VisionStepper, dict[str, Any]]:
    """(model parts, step runner, state) of this rank; ``optimizer_for(model)`` gives the
    optimizer and its LR schedule (job.build_optimizer)."""
    t, plan = spec.training, spec.plan()
    assert spec.vision is not None and spec.multimodal is not None
    torch.manual_seed(t.seed)  # same on every rank: the RNG state is one, not per rank
    parts = build_vlm_model(spec, cfg, ctx, par)
    optimizer, scheduler = optimizer_for(parts.model)
    loader = ImageTextLoader(
        torch.as_tensor(load_tokens(None)),
        cfg.max_seq_len,
        plan.global_batch_size,
        t.seed,
        spec.vision,
        spec.multimodal,
    )
    positions = parts.model.positions.cpu() if par.dims.cp > 1 else None
    schedule = None
    if par.dims.pp > 1:
        schedule = build_schedule(
            parts.stages, parts.stage_ids, par.dims, par.pp_group, ctx.device, accum, text_loss
        )
    stepper = VisionStepper(
        parts, par, optimizer, scheduler, loader, micro, t.grad_clip, ctx.device, schedule,
        positions,
    )  # fmt: skip
    state = {
        "train": ModelOptimizerState(parts.model, optimizer),
        "sched": scheduler,
        "data": loader,
        "rng": RNGState(),
    }
    return parts, stepper, state
