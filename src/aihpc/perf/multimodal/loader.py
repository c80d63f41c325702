"""Host time of a vision-language run's data loader on the step's critical path, in seconds.

Before a rank's step can start, its samples must be loaded: each image decoded, resized and
normalized by the model's image processor (for Qwen-VL also cut into the processor's patch
layout, for InternVL into tiles), and each sample's text put through the chat template and the
tokenizer. With ``multimodal.loader_workers = 0`` (a PyTorch DataLoader's ``num_workers: 0``, as
NeMo AutoModel's VLM recipes set it) this runs in the training process, serially, before every
step: all of it shows. With ``w`` workers the loading of later steps overlaps this one; the
workers fall behind, and the step waits, only where one worker's share of a step's loading,
``loader / w``, exceeds the rest of the step: ``max(0, loader / w - step)``.

**Per step and rank:** ``samples x (images x (decode + process) + text)`` where samples are the
rank's share of the global batch, images a sample drawn from the data fact (as the image sizes:
a distribution, summed over the rank's samples; the step waits for the slowest data-parallel
rank, priced as the expected maximum as imbalance.py prices the encoder's), and

* decode = seconds a pixel of a single-thread Pillow JPEG decode x the image's pixels, or 0
  where ``multimodal.predecoded`` (the images were decoded once, before training);
* process = seconds a pixel of the processor (``multimodal.image_processor``) x its pixels;
* text = seconds a byte of Hugging Face's tokenizers x bytes a token x the sample's text tokens.

An image's pixels are what the processor hands the encoder: for native resolution (Qwen-VL)
``image tokens x merge^2 x patch^2``, for tiles (InternVL, LLaVA AnyRes) ``tiles x image_size^2``.
A source image is at least that large where the processor shrinks it, so the decode priced on
them is a lower bound; the datasets' source sizes are not published with the recipes.

Every figure is a published one, named per row in ``data/loader_figures.csv``, taken per pixel
or per byte as published (one image, one thread); none is fitted to a validation row. The
chat template's rendering has no published figure and is not priced.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from functools import cache
from importlib import resources

from aihpc.perf.multimodal.imbalance import Grid, compound, expected_max
from aihpc.runspec.vision import MultimodalSpec, VisionSpec

__all__ = [
    "LoaderFigures",
    "image_pixels",
    "loader_figures",
    "loader_grid",
    "loader_s",
    "loader_step_s",
    "loader_visible_s",
]


@dataclass(frozen=True)
class LoaderFigures:
    decode_s_per_pixel: float
    processor_s_per_pixel: dict[str, float]  # by multimodal.image_processor
    text_s_per_token: float


def _rate(row: dict[str, str]) -> float:
    return float(row["value"]) / float(row["per"])


@cache
def loader_figures() -> LoaderFigures:
    """The published figures of ``data/loader_figures.csv`` as per-unit rates."""
    path = resources.files("aihpc.perf.multimodal").joinpath("data/loader_figures.csv")
    with path.open(encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    by_kind: dict[str, list[dict[str, str]]] = {}
    for row in rows:
        by_kind.setdefault(row["kind"], []).append(row)
    processors = {r["processor"]: _rate(r) for r in by_kind["processor"]}
    per_byte = _rate(by_kind["text"][0])
    bytes_per_token = _rate(by_kind["text_bytes"][0])
    return LoaderFigures(_rate(by_kind["decode"][0]), processors, per_byte * bytes_per_token)


def image_pixels(v: VisionSpec, image_tokens: float) -> float:
    """Pixels the processor hands the encoder for an image of ``image_tokens`` tokens."""
    cap = v.max_image_tokens or math.inf
    patches, tiles = v.encoder_patches(min(image_tokens, cap))
    if v.resolution == "tiles":
        return tiles * v.image_size**2
    return patches * v.patch_size**2


def loader_grid(v: VisionSpec, mm: MultimodalSpec, samples: int) -> Grid:
    """Serial host seconds to load ``samples`` samples, as a distribution over the data fact's
    images per sample and image sizes (a point at 0 where no processor is named)."""
    if mm.image_processor == "none":
        return Grid.point(0.0)
    f = loader_figures()
    decode = 0.0 if mm.predecoded else f.decode_s_per_pixel
    per_pixel = decode + f.processor_s_per_pixel[mm.image_processor]
    d = mm.image_tokens
    image = Grid.of([per_pixel * image_pixels(v, t) for t in d.values], d.weights)
    sample = compound(mm.images_per_sample, image).add(
        Grid.point(f.text_s_per_token * mm.text_tokens.mean)
    )
    return sample.times(samples)


def loader_s(v: VisionSpec, mm: MultimodalSpec, samples: int) -> float:
    """Mean serial host seconds to load ``samples`` samples."""
    return loader_grid(v, mm, samples).mean


def loader_step_s(v: VisionSpec, mm: MultimodalSpec, samples: int, ranks: int) -> float:
    """The loading a step waits for: the slowest of ``ranks`` data-parallel ranks' (the
    expected maximum, as the encoder's imbalance), each loading ``samples`` samples."""
    return expected_max(loader_grid(v, mm, samples), ranks)


def loader_visible_s(loader: float, workers: int, step: float) -> float:
    """What of ``loader`` seconds of loading a step shows: all of it in the training process
    (workers 0); with ``workers`` processes only one worker's share beyond the step."""
    if workers == 0:
        return loader
    return max(0.0, loader / workers - step)
