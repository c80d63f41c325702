"""Vision-language models: the vision encoder and projector (``[model.vision]``) beside the
language model ``[model]`` describes, and the data fact images bring (``[multimodal]``): images
per sample and tokens per image as distributions, text tokens, packing, what is frozen and
where the encoder runs.

A ``[model]`` preset may name a vision-language model (``runspec/data/vlms.toml``): its language
model's fields and its ``[model.vision]`` table come from the preset, each number with its
source. Imports nothing of aihpc but runspec, and never torch.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, fields
from functools import cache
from importlib import resources
from statistics import NormalDist
from typing import Any

from aihpc.runspec._table import check_choice, check_positive, from_table, lookup_name
from aihpc.runspec.errors import SpecError

__all__ = [
    "IMAGE_PROCESSORS",
    "PLACEMENTS",
    "Distribution",
    "MultimodalSpec",
    "VisionSpec",
    "distribution_from",
    "multimodal_from_table",
    "split_vision",
    "vision_from_table",
    "vlm_presets",
]

# Where the encoder runs (docs/multimodal.md): on the first pipeline stage replicated on every
# TP rank, or split with the language model's TP; as its own pipeline stage on its own GPUs
# (Megatron-Core's encoder_pipeline_model_parallel_size = 1); on a separate pool of GPUs
# (DistMM / DistTrain's disaggregation); spread over the stages into the pipeline's bubbles
# (Optimus). "auto": the search chooses.
PLACEMENTS = ("replicated", "tp", "stage", "pool", "bubble")
RESOLUTIONS = ("tiles", "native")
SCOPES = ("tile", "image")
# The image processor a run's data loader applies (perf/multimodal/loader.py prices it from
# published per-image figures): none (not priced), hf-torchvision (Hugging Face's processors on
# their default torchvision backend), hf-pil (the PIL / NumPy "slow" processors)
IMAGE_PROCESSORS = ("none", "hf-torchvision", "hf-pil")


@dataclass(frozen=True)
class VisionSpec:
    """A ViT encoder and its projector. Field names are the run spec's ``[model.vision]``."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    patch_size: int
    ffn_activation: str = "gelu"  # gelu (CLIP, SigLIP, InternViT) | swiglu (Qwen2.5-VL's ViT)
    # tiles: fixed-size tiles of image_size pixels (LLaVA AnyRes, InternVL dynamic tiling,
    # Llama 3.2 Vision), at most max_tiles per image; native: any size up to max_pixels
    # (Qwen2-VL / Qwen2.5-VL), its patches one sequence
    resolution: str = "tiles"
    image_size: int = 336  # a tile's side in pixels (tiles)
    max_tiles: int = 1
    max_pixels: int = 0  # native: the most pixels an image is resized to (0: no cap)
    class_tokens: int = 0  # per tile (CLIP's and Llama 3.2's class token)
    # what one attention call spans: each tile alone (LLaVA, InternVL) or the whole image's
    # patches (Llama 3.2 Vision attends across its tiles; Qwen2.5-VL's full layers)
    attention_scope: str = "tile"
    # Window attention (Qwen2.5-VL): patches per window, 0 none; full_attention_layers of the
    # num_layers attend to the whole image (Qwen2.5-VL: 4 of 32, fullatt_block_indexes)
    window_patches: int = 0
    full_attention_layers: int = 0
    # Projector: merge x merge patches become one language-model token (Qwen's 2x2 merger,
    # InternVL's pixel shuffle at 0.5), from feature_layers hidden states concatenated (Llama
    # 3.2 Vision: 5 intermediate + the last), through a 2-layer MLP of projector_hidden (0: one
    # linear layer) to the language model's width
    merge: int = 1
    feature_layers: int = 1
    projector_hidden: int = 0
    # Llama 3.2 Vision: the language model's layers that cross-attend to the image tokens
    # instead of taking them in its sequence (counted in [model].num_layers)
    cross_attention_layers: int = 0
    name: str = "custom"
    source: str = ""

    def __post_init__(self) -> None:
        for f in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size"):
            check_positive(f"model.vision.{f}", getattr(self, f))
        for f in ("patch_size", "image_size", "max_tiles", "merge", "feature_layers"):
            check_positive(f"model.vision.{f}", getattr(self, f))
        for f in ("max_pixels", "class_tokens", "window_patches", "full_attention_layers"):
            check_positive(f"model.vision.{f}", getattr(self, f), allow_zero=True)
        for f in ("projector_hidden", "cross_attention_layers"):
            check_positive(f"model.vision.{f}", getattr(self, f), allow_zero=True)
        check_choice("model.vision.ffn_activation", self.ffn_activation, ("gelu", "swiglu"))
        check_choice("model.vision.resolution", self.resolution, RESOLUTIONS)
        check_choice("model.vision.attention_scope", self.attention_scope, SCOPES)
        if self.hidden_size % self.num_attention_heads:
            raise SpecError(
                "model.vision.num_attention_heads",
                self.num_attention_heads,
                f"must divide model.vision.hidden_size {self.hidden_size}",
            )
        if self.full_attention_layers > self.num_layers:
            raise SpecError(
                "model.vision.full_attention_layers",
                self.full_attention_layers,
                f"at most model.vision.num_layers {self.num_layers}",
            )
        if self.image_size < self.patch_size:
            raise SpecError(
                "model.vision.image_size",
                self.image_size,
                f"at least patch_size {self.patch_size}",
            )

    @property
    def patches_per_tile(self) -> int:
        """Encoder tokens of one tile: its patches and class tokens."""
        return (self.image_size // self.patch_size) ** 2 + self.class_tokens

    @property
    def tokens_per_tile(self) -> int:
        """Language-model tokens one tile becomes (class tokens dropped, merged)."""
        return (self.image_size // self.patch_size) ** 2 // (self.merge * self.merge)

    @property
    def max_image_tokens(self) -> int:
        """The most language-model tokens one image can become (0: no cap)."""
        if self.resolution == "tiles":
            return self.tokens_per_tile * self.max_tiles
        return self.max_pixels // (self.patch_size * self.merge) ** 2

    def encoder_patches(self, image_tokens: float) -> tuple[float, float]:
        """(encoder tokens, tiles) of an image that becomes ``image_tokens`` language-model
        tokens: tiles are whole (ceil), native images are merge^2 patches per token."""
        if self.resolution == "tiles":
            tiles = max(1, math.ceil(image_tokens / self.tokens_per_tile - 1e-9))
            return tiles * self.patches_per_tile, float(tiles)
        return image_tokens * self.merge * self.merge, 1.0


@dataclass(frozen=True)
class Distribution:
    """A discrete distribution: values and their probabilities (summing to 1)."""

    values: tuple[float, ...]
    weights: tuple[float, ...]

    @property
    def mean(self) -> float:
        return sum(v * w for v, w in zip(self.values, self.weights, strict=True))

    def quantile(self, q: float) -> float:
        acc = 0.0
        for v, w in sorted(zip(self.values, self.weights, strict=True)):
            acc += w
            if acc >= q - 1e-12:
                return v
        return max(self.values)

    def to_table(self) -> Any:
        if len(self.values) == 1:
            return self.values[0]
        return {"values": list(self.values), "weights": list(self.weights)}


def _lognormal(field: str, mean: float, p99: float, points: int = 64) -> Distribution:
    """A lognormal with this mean and 99th percentile, at ``points`` equal-probability
    quantiles (its mean rescaled to the given one)."""
    z = NormalDist().inv_cdf(0.99)
    r = math.log(p99 / mean)
    if r < 0 or z * z - 2 * r < 0:
        raise SpecError(field, p99, f"p99 must be between the mean {mean} and {mean * 15:g}")
    sigma = z - math.sqrt(z * z - 2 * r)
    mu = math.log(mean) - sigma * sigma / 2
    qs = [NormalDist(mu, sigma).inv_cdf((i + 0.5) / points) for i in range(points)]
    vals = [math.exp(q) for q in qs]
    scale = mean / (sum(vals) / points)
    return Distribution(tuple(v * scale for v in vals), tuple([1.0 / points] * points))


def distribution_from(field: str, value: Any, integer: bool = False) -> Distribution:
    """A number, ``{values = [...], weights = [...]}`` (buckets) or ``{mean = m, p99 = q}``
    (a lognormal) as a Distribution; a bad one is a SpecError naming ``field``."""
    allowed = "a number >= 0, {values = [...], weights = [...]}, or {mean = m, p99 = q}"
    if isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value) or value < 0:
            raise SpecError(field, value, allowed)
        return Distribution((float(value),), (1.0,))
    if not isinstance(value, dict):
        raise SpecError(field, value, allowed)
    if set(value) == {"mean", "p99"}:
        mean, p99 = value["mean"], value["p99"]
        for k, v in (("mean", mean), ("p99", p99)):
            ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            if not ok or v <= 0:
                raise SpecError(f"{field}.{k}", v, "a finite number > 0")
        if p99 == mean:
            return Distribution((float(mean),), (1.0,))
        return _lognormal(f"{field}.p99", float(mean), float(p99))
    if set(value) != {"values", "weights"}:
        raise SpecError(field, "{" + ", ".join(sorted(value)) + "}", allowed)
    vals, weights = value["values"], value["weights"]
    if not isinstance(vals, list) or not isinstance(weights, list) or len(vals) != len(weights):
        raise SpecError(f"{field}.weights", weights, "a list as long as values")
    if not vals:
        raise SpecError(f"{field}.values", vals, "at least one value")
    for v in vals:
        ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        if not ok or v < 0 or (integer and v != int(v)):
            kind = "whole numbers >= 0" if integer else "finite numbers >= 0"
            raise SpecError(f"{field}.values", v, kind)
    for w in weights:
        ok = isinstance(w, int | float) and not isinstance(w, bool) and math.isfinite(w)
        if not ok or w < 0:
            raise SpecError(f"{field}.weights", w, "finite numbers >= 0")
    total = float(sum(weights))
    if total <= 0:
        raise SpecError(f"{field}.weights", weights, "at least one weight > 0")
    return Distribution(tuple(float(v) for v in vals), tuple(w / total for w in weights))


@dataclass(frozen=True)
class MultimodalSpec:
    """The data fact and the training choices of a vision-language run (``[multimodal]``)."""

    images_per_sample: Distribution = Distribution((1.0,), (1.0,))
    image_tokens: Distribution = Distribution((576.0,), (1.0,))  # language-model tokens/image
    text_tokens: Distribution = Distribution((512.0,), (1.0,))
    # true: samples packed into model.seq_length sequences; false: one sample a sequence,
    # padded to the longest of its micro-batch (at most model.seq_length)
    packing: bool = True
    # Unpacked, a micro-batch is padded to: its longest sample (longest: random batches; a
    # step waits for the rank with the longest, perf/multimodal/workload.py), the longest of
    # its chunk of a length-sorted megabatch (grouped: LLaVA's group_by_modality_length
    # sampler), or model.seq_length (max: Megatron-LM's fixed-length samples)
    padding: str = "longest"
    freeze_encoder: bool = False
    freeze_projector: bool = False
    freeze_llm: bool = False
    # full: a trained encoder keeps only its layers' inputs and runs its forward again in the
    # backward (Megatron-Core's recompute of the vision model, ms-swift's
    # vit_gradient_checkpointing, the default of both); none: it keeps every activation
    encoder_recompute: str = "full"
    placement: str = "auto"  # one of PLACEMENTS, or auto (the search chooses)
    encoder_tp: int = 0  # the encoder's own TP (stage, pool); 0: the search chooses
    encoder_gpus: int = 0  # pool: GPUs of the encoder pool; 0: the search chooses
    # The data loader: the processor that decodes and resizes each image on the host (none: the
    # loader is not priced) and the DataLoader's worker processes (0: it runs in the training
    # process, serially before each step; w: w processes working ahead of the step)
    image_processor: str = "none"
    loader_workers: int = 0
    # true: every image was decoded once before training (a recipe that builds its data set as
    # a list by iterating a Hugging Face data set, whose Image feature loads each image as it is
    # read), so a step's loading resizes and normalises but decodes nothing
    predecoded: bool = False

    def __post_init__(self) -> None:
        check_choice("multimodal.placement", self.placement, ("auto", *PLACEMENTS))
        check_choice("multimodal.image_processor", self.image_processor, IMAGE_PROCESSORS)
        check_positive("multimodal.loader_workers", self.loader_workers, allow_zero=True)
        check_choice("multimodal.padding", self.padding, ("longest", "grouped", "max"))
        check_choice("multimodal.encoder_recompute", self.encoder_recompute, ("full", "none"))
        check_positive("multimodal.encoder_tp", self.encoder_tp, allow_zero=True)
        check_positive("multimodal.encoder_gpus", self.encoder_gpus, allow_zero=True)

    def sample_tokens(self) -> float:
        """Mean language-model tokens of one sample (images' and text)."""
        return self.images_per_sample.mean * self.image_tokens.mean + self.text_tokens.mean

    def to_table(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.to_table() if isinstance(v, Distribution) else v
        return out


_DISTRIBUTIONS = ("images_per_sample", "image_tokens", "text_tokens")


def multimodal_from_table(table: dict[str, Any]) -> MultimodalSpec:
    """``[multimodal]`` → MultimodalSpec; distributions as ``distribution_from`` reads them."""
    table = dict(table)
    dists = {
        k: distribution_from(f"multimodal.{k}", table.pop(k), integer=k == "images_per_sample")
        for k in _DISTRIBUTIONS
        if k in table
    }
    spec = from_table(MultimodalSpec, table, "multimodal")
    return MultimodalSpec(**{**{f.name: getattr(spec, f.name) for f in fields(spec)}, **dists})


@cache
def vlm_presets() -> dict[str, dict[str, Any]]:
    """Vision-language presets from ``runspec/data/vlms.toml``: each a language model (``llm``,
    a preset name or its fields) and a ``vision`` table, every number with its source."""
    text = resources.files("aihpc.runspec").joinpath("data/vlms.toml").read_text()
    return tomllib.loads(text)


def vision_from_table(table: Any, where: str = "model.vision") -> VisionSpec:
    if not isinstance(table, dict):
        raise SpecError(where, table, "expected a table")
    return from_table(VisionSpec, dict(table), where)


def split_vision(model: dict[str, Any]) -> tuple[dict[str, Any], VisionSpec | None]:
    """A ``[model]`` table → (the language model's table, the vision encoder or None): a
    vision-language preset gives both (the table's fields override the language model's, its
    ``vision`` table the encoder's); a ``vision`` sub-table gives the encoder of any model."""
    model = dict(model)
    vision = model.pop("vision", None)
    preset = model.get("preset")
    vlms = vlm_presets()
    if isinstance(preset, str) and preset.lower() in {k.lower() for k in vlms}:
        name = lookup_name("model.preset", preset, vlms)
        entry = vlms[name]
        llm = entry["llm"]
        model.pop("preset")
        base = {"preset": llm} if isinstance(llm, str) else dict(llm)
        model = {**base, "name": name, "source": entry["source"], **model}
        vision = {**entry["vision"], **(vision or {})}
        vision.setdefault("name", name)
    if vision is None:
        return model, None
    return model, vision_from_table(vision)
