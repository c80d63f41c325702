"""Image-text samples the trainer generates itself, deterministically, and the loader that serves
them (resumable as ``data.TokenLoader``: its state is the sample cursor).

Sample ``i`` of a run is drawn from a generator seeded by (seed, i) alone, so any plan, world
size or resume sees the same samples. It carries ``n`` images, ``n`` drawn from
``[multimodal].images_per_sample``; each image is a coloured shape (square, circle, diamond, cross
in one of six colours, of a random size and place, on a faint noise) and is followed in the
sequence by its caption ("red circle\\n") as bytes, so the text after an image can only be
predicted by looking at it. The sequence is ``seq_len + 1`` byte tokens: for each image its
tokens_per_tile placeholder tokens (``IMAGE_TOKEN``, byte 0, which the shipped text never holds)
and its caption, then the shipped text sample from a random offset. Targets that are image
placeholders are ``IGNORE`` (no loss on the image positions).
"""

from __future__ import annotations

from typing import Any

import torch

from aihpc.runspec.vision import MultimodalSpec, VisionSpec
from aihpc.runspec.vlm_rules import CAPTION_TOKENS

__all__ = ["COLOURS", "IGNORE", "IMAGE_TOKEN", "SHAPES", "ImageTextLoader", "draw_image"]

IMAGE_TOKEN = 0
IGNORE = -100
COLOURS = {
    "red": (1.0, 0.1, 0.1),
    "green": (0.1, 0.9, 0.2),
    "blue": (0.15, 0.25, 1.0),
    "yellow": (0.95, 0.9, 0.1),
    "purple": (0.6, 0.1, 0.8),
    "white": (1.0, 1.0, 1.0),
}
SHAPES = ("square", "circle", "diamond", "cross")


def draw_image(size: int, gen: torch.Generator) -> tuple[torch.Tensor, str]:
    """One image (3, size, size) in [0, 1] and its caption."""
    colour = list(COLOURS)[int(torch.randint(len(COLOURS), (1,), generator=gen))]
    shape = SHAPES[int(torch.randint(len(SHAPES), (1,), generator=gen))]
    r = size / 8 + float(torch.rand(1, generator=gen)) * size / 5  # half the shape's side
    cy, cx = (r + torch.rand(2, generator=gen) * (size - 2 * r)).tolist()
    y, x = torch.meshgrid(torch.arange(size) + 0.5, torch.arange(size) + 0.5, indexing="ij")
    dy, dx = (y - cy).abs(), (x - cx).abs()
    if shape == "square":
        mask = (dy <= r) & (dx <= r)
    elif shape == "circle":
        mask = dy**2 + dx**2 <= r**2
    elif shape == "diamond":
        mask = dy + dx <= r
    else:
        mask = ((dy <= r / 3) & (dx <= r)) | ((dx <= r / 3) & (dy <= r))
    image = torch.rand(3, size, size, generator=gen) * 0.1
    rgb = torch.tensor(COLOURS[colour])[:, None, None]
    image = torch.where(mask[None], rgb.expand(3, size, size), image)
    return image, f"{colour} {shape}\n"


class ImageTextLoader:
    """Global batches of (inputs, targets, images); Stateful (its state is the sample cursor).

    ``images`` is (rows, most images a sample may carry, 3, image_size, image_size); a sample's
    images fill its first slots in the order of their placeholders, the rest are zeros (a sample
    has as many images as it has groups of placeholders)."""

    def __init__(
        self,
        text: torch.Tensor,
        seq_len: int,
        global_batch: int,
        seed: int,
        vision: VisionSpec,
        mm: MultimodalSpec,
    ):
        self.text = text
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.image_size = vision.image_size
        self.image_tokens = vision.tokens_per_tile
        dist = mm.images_per_sample
        self.counts = [int(v) for v in dist.values]
        self.weights = torch.tensor(dist.weights, dtype=torch.float64)
        self.max_images = max(c for c, w in zip(self.counts, dist.weights, strict=True) if w > 0)
        self.cursor = 0  # samples consumed by the whole job so far
        self.last_images: list[int] = []  # images per row of the last next_rows

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``index``: its seq_len + 1 tokens and its images (max_images, 3, s, s)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        n = self.counts[int(torch.multinomial(self.weights, 1, generator=gen))]
        n = min(n, self.max_images)
        images = torch.zeros(self.max_images, 3, self.image_size, self.image_size)
        pieces = []
        for k in range(n):
            images[k], caption = draw_image(self.image_size, gen)
            words = torch.tensor(list(caption.encode()), dtype=torch.int64)[:CAPTION_TOKENS]
            pieces += [torch.full((self.image_tokens,), IMAGE_TOKEN, dtype=torch.int64), words]
        used = sum(len(p) for p in pieces)
        rest = self.seq_len + 1 - used
        start = int(torch.randint(len(self.text) - rest, (1,), generator=gen))
        pieces.append(self.text[start : start + rest].to(torch.int64))
        return torch.cat(pieces), images

    def next_rows(self, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inputs, targets (rows, seq_len) and images of data-parallel rank ``dp_rank`` of ``dp``
        in the next global batch (its contiguous slice, as TokenLoader's); advances the cursor."""
        per_rank = self.global_batch // dp
        first = self.cursor + dp_rank * per_rank
        rows, images = zip(*(self.sample(i) for i in range(first, first + per_rank)), strict=True)
        batch = torch.stack(rows)
        self.cursor += self.global_batch
        x, y = batch[:, :-1], batch[:, 1:].clone()
        y[y == IMAGE_TOKEN] = IGNORE
        self.last_images = [int((r == IMAGE_TOKEN).sum()) // self.image_tokens for r in x]
        return x, y, torch.stack(images)

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "seq_len": self.seq_len, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seq_len", "seed"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"checkpoint data {key} = {state[key]} but this run has "
                    f"{getattr(self, key)}: resuming with other settings would not continue "
                    "the same sample sequence"
                )
        self.cursor = int(state["cursor"])
