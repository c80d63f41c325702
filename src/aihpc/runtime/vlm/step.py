"""One optimizer step of the VLM under any plan the trainer runs for it: step.Stepper with images
beside the tokens and the loss on the text.

The loss of a micro-batch is the sum of the text tokens' cross-entropies over the count of all
its positions (image placeholders count, at zero loss): the same denominator on every rank of a
plan, whatever images its rows carry, so the mean over data- and context-parallel ranks that the
gradient reduction and ``Stepper.step`` take is the one-process loss of the global batch.
Dividing each rank's sum by its own text tokens instead would weight a rank with more images up.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from aihpc.runtime.step import Stepper
from aihpc.runtime.vlm.images import IGNORE

__all__ = ["VisionStepper", "text_loss"]


def text_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of the text targets (image positions are IGNORE) over all positions;
    logits may be a vocabulary-sharded DTensor (loss parallel)."""
    total = F.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), reduction="sum", ignore_index=IGNORE
    )
    return total / targets.numel()


@dataclass
class VisionStepper(Stepper):
    """Stepper for VisionLlama: the loader gives (tokens, targets, images); under context
    parallel the model takes the whole sequence's tokens (it places the images, then keeps its
    positions) and the targets are cut to its positions."""

    images: torch.Tensor | None = None
    # per step: images on each data-parallel rank and its encoder's forward seconds (rank 0's
    # view of every rank, for the summary's measured imbalance)
    image_log: list[dict[str, Any]] = field(default_factory=list)

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y, images = self.loader.next_rows(self.par.dp_rank, self.par.dims.dp)
        if self.positions is not None:
            y = y[:, self.positions]
        self.images = images.to(self.device)
        return x.to(self.device), y.to(self.device)

    def _microbatches(self, x: torch.Tensor, y: torch.Tensor) -> Iterator[tuple[Any, ...]]:
        assert self.images is not None
        n = x.shape[0] // self.micro
        rows = (x.split(self.micro), y.split(self.micro), self.images.split(self.micro))
        for i, (xm, ym, im) in enumerate(zip(*rows, strict=True)):
            yield i == n - 1, n, (xm, im), ym

    def _stage_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        assert self.images is not None
        return x, self.images

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return text_loss(logits, targets)

    def step(self, autocast: Any) -> float:
        vlm = _inner(self.parts.model)
        vlm.encoder_s, vlm.images_seen = 0.0, 0
        loss = super().step(autocast)
        self._log_images(vlm)
        return loss

    def _log_images(self, vlm: Any) -> None:
        """Every rank's images and encoder forward seconds of the step just taken."""
        mine = torch.tensor(
            [float(vlm.images_seen), vlm.encoder_s], dtype=torch.float64, device=self.device
        )
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        self.image_log.append(
            {
                "images": [int(t[0]) for t in every],
                "encoder_forward_s": [float(t[1]) for t in every],
            }
        )


def _inner(model: torch.nn.Module) -> Any:
    return model.module if hasattr(model, "no_sync") and hasattr(model, "module") else model
