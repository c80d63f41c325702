"""The policy update under pipeline parallel: the trainer's ``Stepper`` (runtime/step.py) and
pipeline schedules (runtime/pp.py: 1F1B, interleaved 1F1B, zero-bubble V), its hooks fed a GRPO
minibatch instead of text, and the full model gathered from the stages for the rollout.

The schedule splits a minibatch's rows into micro-batches of ``[parallel] micro_batch_size``;
the first stage takes the token inputs (prompt and response, less the last token), the last
stage a ``target`` that packs per token what the loss needs: the sampled token, the mask, the
old-policy and reference log-probabilities and the response's advantage (``pack_grpo``). Each
micro-batch's loss is the GRPO objective's mean over its responses and the schedule divides the
gradients by the micro-batch count, so the gradient is the one-process minibatch's. The
supervised warm-up runs the same way on answers padded to the GRPO inputs' width, its loss per
micro-batch scaled so that the sum over the step is the global batch's token mean.

Weights: each pipeline rank holds its stages' parameters; ``gather_stages`` puts every rank's
whole (data / tensor parallel gathered) weights together over the pipeline group, in the plain
model's order, for the colocated rollout model and the disaggregated pool alike. A checkpoint
holds the merged model and optimizer state (the same file as one process writes: a run resumes
under another plan); ``own_part`` picks a rank's keys back out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from aihpc.runtime.pp import build_schedule
from aihpc.runtime.rl.grpo import policy_loss, whole_logits
from aihpc.runtime.step import Stepper

__all__ = ["PolicyStepper", "gather_stages", "merge_states", "own_part", "pack_grpo"]

GRPO_FIELDS = 5  # token, mask, old, reference, advantage


class _NoSchedule:
    """The update's learning rate is constant: a schedule that does not move it (a LambdaLR
    would add keys to the optimizer's state)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def step(self) -> None:
        pass

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]


def pack_grpo(
    responses: torch.Tensor, mask: torch.Tensor, old: torch.Tensor, ref: Any, adv: torch.Tensor
) -> torch.Tensor:
    """(rows, steps, 5) float: what the last stage's loss reads per token (token ids < 2**24
    are exact in fp32)."""
    ref = torch.zeros_like(old) if ref is None else ref
    return torch.stack(
        [responses.float(), mask.float(), old, ref, adv[:, None].expand_as(old)], dim=-1
    )


@dataclass
class PolicyStepper(Stepper):
    """A Stepper whose loss is GRPO's (``kind`` "grpo") or the warm-up's weighted cross-entropy
    ("sft"); the trainer sets ``pending`` (inputs, packed targets) before each ``step``."""

    kind: str = "grpo"
    clip: float = 0.2
    kl_coef: float = 0.0
    sft_scale: float = 1.0  # sft: dp x micro-batches / the global batch's answer tokens
    pending: tuple[torch.Tensor, torch.Tensor] | None = None
    stats: list[dict[str, float]] = field(default_factory=list)

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.pending is not None
        x, y = self.pending
        self.pending = None
        return x.to(self.device), y.to(self.device)

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = whole_logits(logits).float()
        if self.kind == "sft":
            y, w = target[..., 0].long(), target[..., 1]
            ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
            return (ce * w.flatten()).sum() * self.sft_scale
        steps = target.shape[1]
        tokens = target[..., 0].long()
        logp = logits[:, -steps:].log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
        ref = target[..., 3] if self.kl_coef > 0 else None
        loss, stats = policy_loss(
            logp, target[..., 2], ref, target[:, 0, 4], target[..., 1] > 0, self.clip, self.kl_coef
        )
        stats["tokens"] = float(target[..., 1].sum())
        self.stats.append(stats)  # the schedule's shape inference adds one: read the last n
        return loss

    def run(self, x: torch.Tensor, target: torch.Tensor) -> tuple[float, dict[str, float]]:
        """One optimizer step on (inputs, packed targets): the global loss and, on the last
        stage, the mean of its micro-batches' statistics (zeros elsewhere)."""
        self.stats.clear()
        self.pending = (x, target)
        loss = self.step(None)
        n = x.shape[0] // self.micro
        mine = self.stats[-n:] if self.parts.last and self.stats else []
        tokens = sum(s["tokens"] for s in mine)
        return loss, {  # KL: a mean over responses; the clipped fraction: over tokens
            "kl": sum(s["kl"] for s in mine) / max(len(mine), 1),
            "clip_fraction": sum(s["clip_fraction"] * s["tokens"] for s in mine) / max(tokens, 1),
        }


def policy_stepper(
    parts: Any,
    par: Any,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    rows: int,
    micro: int,
    grad_clip: float,
    **loss: Any,
) -> PolicyStepper:
    """A stepper with its own schedule (its stages infer their shapes at the first step) for
    minibatches of ``rows`` rows on this data-parallel rank."""
    stepper = PolicyStepper(
        parts, par, optimizer, _NoSchedule(optimizer), None, micro, grad_clip, device, **loss
    )  # fmt: skip
    stepper.schedule = build_schedule(
        parts.stages, parts.stage_ids, par.dims, par.pp_group, device, rows // micro,
        stepper._loss,
    )  # fmt: skip
    return stepper


def gather_stages(
    weights: dict[str, torch.Tensor], group: Any, order: list[str]
) -> dict[str, torch.Tensor]:
    """Every pipeline rank's ``weights`` (its stages' whole tensors) merged, in ``order`` (the
    plain model's state dict keys); a collective over the pipeline ``group``."""
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, {k: v.detach().cpu() for k, v in weights.items()}, group=group)
    merged = {k: v for part in every for k, v in part.items()}
    missing = [k for k in order if k not in merged]
    if missing:
        raise RuntimeError(f"pipeline stages hold no weight {missing[0]}")
    return {k: merged[k] for k in order}


def merge_states(parts: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """The pipeline ranks' (model, optimizer) full state dicts, one whole model's: the model's
    tensors and the optimizer's per-parameter states together, each group's parameters in stage
    order."""
    model: dict[str, Any] = {}
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for model_sd, optim_sd in parts:
        model |= model_sd
        state |= optim_sd["state"]
        for i, group in enumerate(optim_sd["param_groups"]):
            if i == len(groups):
                groups.append({**group, "params": []})
            groups[i]["params"] += list(group["params"])
    return model, {"state": state, "param_groups": groups}


def own_part(model_sd: dict, optim_sd: dict, keep: Callable[[str], bool]) -> tuple[dict, dict]:
    """The (model, optimizer) full state dicts cut to the parameters ``keep`` accepts."""
    groups = [
        {**g, "params": [p for p in g["params"] if keep(p)]} for g in optim_sd["param_groups"]
    ]
    return (
        {k: v for k, v in model_sd.items() if keep(k)},
        {"state": {k: v for k, v in optim_sd["state"].items() if keep(k)}, "param_groups": groups},
    )
