"""A plan applied to the vision-language model, in parallelize.py's order: pipeline split (the
encoder on the first stage) → tensor parallel (the decoder as for text; the encoder replicated on
the TP ranks) → context parallel (the decoder's layers; every CP rank encodes its rows' images and
keeps its positions' embeddings) → data parallel (DDP, or FSDP2 with each encoder block its own
unit) → allocate → ``init_weights``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from aihpc.runspec import RunSpec
from aihpc.runtime.config import LlamaConfig
from aihpc.runtime.distributed import DistContext
from aihpc.runtime.mesh import Parallel
from aihpc.runtime.parallelize import ModelParts, apply_cp, apply_dp
from aihpc.runtime.pp import StageModule, stage_ids, stage_layers
from aihpc.runtime.speed import mp_policy
from aihpc.runtime.tp import apply_tp
from aihpc.runtime.vlm.model import VisionLlama

__all__ = ["VisionStage", "build_vlm_model"]


class VisionStage(StageModule):
    """A pipeline stage of the VLM: the first takes (tokens, images) and holds the encoder."""

    def __init__(self, model: VisionLlama, layers: list[int], first: bool, last: bool) -> None:
        super().__init__(model, layers, first, last)
        self.vision = model.vision if first else None

    def forward(self, x: torch.Tensor, images: torch.Tensor | None = None) -> torch.Tensor:
        model = self._model[0]
        h = model.embed(x, images) if self.tok_embeddings is not None else x
        return model.run_layers(h, self.layers.values(), last=self.output is not None)


def _stages(model: VisionLlama, par: Parallel) -> ModelParts:
    """Keep only this rank's stages' layers; the encoder and embedding on the first stage."""
    dims = par.dims
    ids = stage_ids(dims, par.pp_rank)
    n = dims.pp * dims.vpp
    split = stage_layers(model.cfg.num_layers, n)
    owned = {str(i) for s in ids for i in split[s]}
    for key in [k for k in model.layers if k not in owned]:
        del model.layers[key]
    if 0 not in ids:
        model.tok_embeddings = model.vision = None
    if n - 1 not in ids:
        model.norm = model.output = None
    stages = [VisionStage(model, split[s], s == 0, s == n - 1) for s in ids]
    return ModelParts(model, stages, ids, n)


def _apply_tp(model: VisionLlama, par: Parallel) -> None:
    """The decoder as apply_tp lays it out, but for its embedding, which gives every TP rank the
    whole sequence (the image tokens go in before the cut to the sequence shard, model.embed);
    the encoder's parameters Replicate DTensors on the TP mesh."""
    mesh = par.tp_mesh
    embeddings, model.tok_embeddings = model.tok_embeddings, None
    apply_tp(model, mesh, par.dims.sequence_parallel)
    model.tok_embeddings = embeddings
    if embeddings is not None:
        plan = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        parallelize_module(model, mesh, {"tok_embeddings": plan})
    if model.vision is not None:
        for module in model.vision.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                whole = DTensor.from_local(p.detach(), mesh, [Replicate()], run_check=False)
                setattr(module, name, nn.Parameter(whole, requires_grad=p.requires_grad))
    model.tp_mesh = mesh
    model.sequence_parallel = par.dims.sequence_parallel


def build_vlm_model(spec: RunSpec, cfg: LlamaConfig, ctx: DistContext, par: Parallel) -> ModelParts:
    """The rank's part of the VLM, initialised from training.seed (the same values under any
    plan), parallelised as ``par`` says."""
    t, plan, mm = spec.training, spec.plan(), spec.multimodal
    assert spec.vision is not None and mm is not None
    with torch.device("meta"):
        model = VisionLlama(
            cfg,
            spec.vision,
            plan.recompute,
            plan.recompute_modules,
            encoder_recompute=mm.encoder_recompute == "full",
        )
    dims = par.dims
    parts = _stages(model, par) if dims.pp > 1 else ModelParts(model)
    if dims.cp > 1:
        apply_cp(model, par)
        model.cp = dims.cp
    if dims.tp > 1:
        _apply_tp(model, par)
    if dims.pure_data_parallel and dims.zero_stage == 0:
        model.to_empty(device=ctx.device)
        model.init_weights(t.seed)
        if ctx.world_size > 1:
            ids = [ctx.device.index] if ctx.device.type == "cuda" else None
            parts.model = DistributedDataParallel(model, device_ids=ids)
        return parts
    _shard_encoder(model, par, mp_policy(t, ctx.device.type))
    apply_dp(parts, par, mp_policy(t, ctx.device.type))
    model.to_empty(device=ctx.device)
    model.init_weights(t.seed)
    return parts


def _shard_encoder(model: VisionLlama, par: Parallel, policy: Any) -> None:
    """Each encoder block an FSDP2 unit of its own (the rest of the encoder joins its stage's
    root unit in apply_dp)."""
    mesh = par.fsdp_mesh()
    if model.vision is None or mesh.size() == 1:
        return
    kw = {"reshard_after_forward": par.dims.zero_stage == 3} | (
        {"mp_policy": policy} if policy else {}
    )
    for block in model.vision.blocks:
        fully_shard(block, mesh=mesh, **kw)
