"""What aihpc's trainer runs of a vision-language run spec (``[model.vision]``, ``[multimodal]``),
as rules without torch: ``rules.trainer_refusal`` asks these, so ``aihpc train`` refuses a spec
before any process starts and the planner marks the same plans.

The trainer's VLM (runtime/vlm/): a ViT over fixed-size single-tile images (patch embedding, a
learned position table, pre-norm blocks of full bidirectional attention and a GELU MLP), a linear
or two-layer projector to the language model's width, each image's tokens placed in the text
sequence; one sample a sequence of model.seq_length tokens (its images first, then text), so
``packing = false`` and ``padding = "max"``. The encoder runs on every tensor- and
context-parallel rank of the first pipeline stage (placement "replicated"). Everything else is
refused here in one line naming the field.
"""

from __future__ import annotations

from aihpc.runspec.errors import SpecError
from aihpc.runspec.parallel import ParallelPlan
from aihpc.runspec.runspec import RunSpec

__all__ = [
    "CAPTION_TOKENS",
    "TRAINER_VLM_PLACEMENTS",
    "trainer_placement_refusal",
    "trainer_vision_refusal",
]

# Caption tokens the trainer's data allows per image (runtime/vlm/images.py), with its image
# tokens: what must fit in model.seq_length for the most images a sample may carry.
CAPTION_TOKENS = 16
TRAINER_VLM_PLACEMENTS = ("auto", "replicated")


def _err(field: str, value: object, allowed: str) -> SpecError:
    return SpecError(field, value, allowed)


def _encoder_refusal(spec: RunSpec) -> SpecError | None:
    v = spec.vision
    assert v is not None
    fixed = {
        "resolution": ("tiles", "single-tile images"),
        "max_tiles": (1, "one tile an image"),
        "class_tokens": (0, "no class token"),
        "window_patches": (0, "full attention in every layer"),
        "cross_attention_layers": (0, "image tokens in the sequence, no cross-attention"),
        "feature_layers": (1, "the last layer's features"),
        "merge": (1, "one token a patch"),
        "ffn_activation": ("gelu", "a GELU MLP"),
    }
    for name, (allowed, why) in fixed.items():
        if getattr(v, name) != allowed:
            return _err(
                f"model.vision.{name}",
                getattr(v, name),
                f"the trainer's ViT takes {why}; allowed: {allowed}",
            )
    if v.image_size % v.patch_size:
        return _err(
            "model.vision.image_size",
            v.image_size,
            f"the trainer cuts whole patches: a multiple of patch_size {v.patch_size}",
        )
    return None


def _data_refusal(spec: RunSpec) -> SpecError | None:
    mm, v = spec.multimodal, spec.vision
    assert mm is not None and v is not None
    if mm.packing or mm.padding != "max":
        field, value = (
            ("multimodal.packing", True) if mm.packing else ("multimodal.padding", mm.padding)
        )
        return _err(
            field,
            value,
            "the trainer's data is one sample a sequence of model.seq_length tokens; "
            'allowed: packing = false, padding = "max"',
        )
    t = v.tokens_per_tile
    if mm.image_tokens.values != (float(t),):
        return _err(
            "multimodal.image_tokens",
            mm.image_tokens.to_table(),
            f"the trainer's images are one tile of (image_size / patch_size)^2 = {t} tokens; "
            f"allowed: {t}",
        )
    most = int(
        max(
            v
            for v, w in zip(mm.images_per_sample.values, mm.images_per_sample.weights, strict=True)
            if w > 0
        )
    )
    if most * (t + CAPTION_TOKENS) > spec.model.seq_length:
        return _err(
            "multimodal.images_per_sample",
            most,
            f"{most} images x ({t} image + {CAPTION_TOKENS} caption tokens) must fit "
            f"model.seq_length {spec.model.seq_length}",
        )
    for name in ("freeze_encoder", "freeze_projector", "freeze_llm"):
        if getattr(mm, name):
            return _err(f"multimodal.{name}", True, "the trainer trains every part; allowed: false")
    if mm.placement not in TRAINER_VLM_PLACEMENTS:
        return _err(
            "multimodal.placement",
            mm.placement,
            "the trainer runs the encoder on every TP / CP rank of the first pipeline stage; "
            "allowed: " + " | ".join(TRAINER_VLM_PLACEMENTS),
        )
    return None


def _vlm_plan_refusal(spec: RunSpec, plan: ParallelPlan) -> SpecError | None:
    if spec.model.is_moe:
        return _err(
            "model.num_experts",
            spec.model.num_experts,
            "the trainer's vision-language model has a dense language model; allowed: 0",
        )
    if spec.training.compile:
        return _err(
            "training.compile", True, "not with [model.vision] in the trainer; allowed: false"
        )
    if spec.training.precision == "fp8":
        return _err(
            "training.precision", "fp8", "not with [model.vision] in the trainer; allowed: bf16"
        )
    if plan.pp > 1 and plan.schedule == "zbv":
        return _err(
            "parallel.pp_schedule",
            "zbv",
            "the encoder on the first stage would share a rank with the last; "
            "allowed with [model.vision]: 1f1b | interleaved-1f1b",
        )
    return None


def trainer_vision_refusal(spec: RunSpec, plan: ParallelPlan | None = None) -> SpecError | None:
    """The first [model.vision] / [multimodal] field (or plan choice) the trainer's VLM would not
    honour, or None; None too for a text-only spec."""
    if spec.vision is None:
        return None
    if spec.multimodal is None:
        return _err("multimodal", None, "the trainer needs the data fact: add [multimodal]")
    plan = spec.plan() if plan is None else plan
    return _encoder_refusal(spec) or _data_refusal(spec) or _vlm_plan_refusal(spec, plan)


def trainer_placement_refusal(placement: str, encoder_tp: int) -> SpecError | None:
    """A placement ``aihpc search`` priced that the trainer does not run, or None: it runs the
    encoder whole on each rank of the first stage ("replicated", or "tp" at encoder TP 1)."""
    if placement == "replicated" or (placement == "tp" and encoder_tp == 1):
        return None
    return _err(
        "multimodal.placement",
        placement,
        "the trainer runs the encoder whole on every TP / CP rank of the first pipeline stage; "
        "allowed: replicated",
    )
