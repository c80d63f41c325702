"""One optimizer step of any plan: this rank's batch, forward and backward (micro-batch loop or
pipeline schedule), gradient clipping over every parallel axis, optimizer, and the step's loss.

The loss of a step is the mean token loss of the whole global batch, whatever the plan: each
rank that computes a loss holds the mean over its tokens (its data-parallel slice, its context-
parallel chunk, every tensor-parallel rank the same value), so a sum over the world of each
value / (dp x cp x tp) from the ranks of the last pipeline stage is that mean.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from aihpc.runtime.data import TokenLoader
from aihpc.runtime.mesh import Parallel
from aihpc.runtime.moe import update_expert_bias
from aihpc.runtime.parallelize import ModelParts

__all__ = ["Stepper", "clip_grad_norm", "token_loss"]


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over tokens; logits (batch, seq, vocab), possibly a vocabulary-
    sharded DTensor (loss parallel: inside ``loss_parallel()`` no rank gathers the vocabulary)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _norms_sq(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Sum of squared gradient norms over all the parameters of this rank's stages: one
    reduction per (mesh, placements) group of DTensor gradients, none for plain tensors."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            g = p.grad
            key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
            groups.setdefault(key, []).append(g)
    total = torch.zeros((), dtype=torch.float32)
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total = total + norm.float().cpu() ** 2
    return total


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, pp_group: Any) -> float:
    """Clip to ``max_norm`` by the global gradient norm: over data / tensor / context parallel
    shards (DTensor reductions) and over pipeline stages (an all-reduce of the squared norms)."""
    total_sq = _norms_sq(params)
    if pp_group is not None:
        device = params[0].device if params else total_sq.device
        total_sq = total_sq.to(device)
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    # one call per device mesh: expert weights (EP x expert-DP mesh) and the rest (DP mesh)
    # cannot meet in one foreach op
    meshes: dict[Any, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            meshes.setdefault(key, []).append(p)
    for group in meshes.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total.to(group[0].device))
    return float(total)


@dataclass
class Stepper:
    """Runs optimizer steps for one plan on this rank."""

    parts: ModelParts
    par: Parallel
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loader: TokenLoader
    micro: int
    grad_clip: float
    device: torch.device
    schedule: Any = None  # the pipeline schedule, when pp > 1
    positions: torch.Tensor | None = None  # context parallel: this rank's token positions
    moe: bool = False  # the model has MoE layers: their routing bias moves after each step
    # what the last step spent where, and its gradient norm (for the metrics exporter)
    last_phases: dict[str, float] = field(default_factory=dict)
    last_grad_norm: float | None = None
    last_step_s: float = 0.0  # the phases' sum

    def _loss_ctx(self) -> AbstractContextManager[Any]:
        return loss_parallel() if self.par.dims.tp > 1 else nullcontext()

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This data-parallel rank's sequences of the next global batch, (rows, seq) inputs and
        targets; under context parallel only this rank's tokens (the model's positions)."""
        x, y = self.loader.next_rows(self.par.dp_rank, self.par.dims.dp)
        if self.positions is not None:
            x, y = x[:, self.positions], y[:, self.positions]
        return x.to(self.device), y.to(self.device)

    def _microbatches(self, x: torch.Tensor, y: torch.Tensor) -> Iterator[tuple[Any, ...]]:
        """(last, count, the model's inputs, targets) of each micro-batch."""
        n = x.shape[0] // self.micro
        for i, (xm, ym) in enumerate(zip(x.split(self.micro), y.split(self.micro), strict=True)):
            yield i == n - 1, n, (xm,), ym

    def _stage_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What the first pipeline stage takes for the whole local batch."""
        return (x,)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return token_loss(logits, targets)

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor, autocast: Any) -> torch.Tensor:
        """Gradient accumulation over micro-batches; the mean loss of this rank's tokens."""
        model = self.parts.model
        fsdp = hasattr(model, "set_requires_gradient_sync")
        ddp = hasattr(model, "no_sync")
        local = torch.zeros((), dtype=torch.float32, device=self.device)
        for last, n, inputs, ym in self._microbatches(x, y):
            if fsdp:
                model.set_requires_gradient_sync(last)
            sync = model.no_sync() if ddp and not last else nullcontext()
            with sync, self._loss_ctx():
                with autocast:
                    logits = model(*inputs)
                loss = self._loss(logits, ym) / n
                loss.backward()
            value = loss.detach()
            local += value.full_tensor() if isinstance(value, DTensor) else value
        return local

    def _pipeline(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One step of the pipeline schedule; the mean loss on ranks of the last stage, else 0."""
        losses: list[torch.Tensor] = []
        args = self._stage_inputs(x) if self.parts.first else ()
        target = y if self.parts.last else None
        with self._loss_ctx():
            self.schedule.step(*args, target=target, losses=losses)
        if not self.parts.last:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        values = [v.full_tensor() if isinstance(v, DTensor) else v for v in losses]
        return torch.stack([v.detach().float() for v in values]).mean()

    def step(self, autocast: Any) -> float:
        """One optimizer step; the global batch's mean loss."""
        t0 = time.perf_counter()
        x, y = self._batch()
        t_data = time.perf_counter()
        if self.schedule is not None:
            local = self._pipeline(x, y)
        else:
            local = self._forward_backward(x, y, autocast)
        t_fb = time.perf_counter()
        params = [p for p in self.parts.model.parameters() if p.requires_grad]
        self.last_grad_norm = None
        if self.grad_clip > 0:
            pp_group = self.par.pp_group if self.par.dims.pp > 1 else None
            self.last_grad_norm = clip_grad_norm(params, self.grad_clip, pp_group)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.moe:  # loads counted over this stage's global batch (DeepSeek-V3 §2.1.2)
            update_expert_bias(self.parts.model, self.par.batch_group())
        t_opt = time.perf_counter()
        d = self.par.dims
        weight = 1.0 / (d.dp * d.cp * d.tp) if self.parts.last else 0.0
        total = local * weight
        dist.all_reduce(total)
        loss = total.item()
        end = time.perf_counter()
        self.last_step_s = end - t0
        self.last_phases = {
            "data_wait": t_data - t0,
            "forward_backward": t_fb - t_data,
            "optimizer": t_opt - t_fb,
            "loss_sync": end - t_opt,
        }
        return loss
