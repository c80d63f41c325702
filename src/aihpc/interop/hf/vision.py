"""Hugging Face ``config.json`` of a vision-language model → the language model's config and the
run spec's ``[model.vision]`` table, for the layouts the model repositories publish:

- Qwen2-VL / Qwen2.5-VL (``model_type`` qwen2_vl / qwen2_5_vl): the language model's keys at the
  top level (or in ``text_config``), ``vision_config`` with ``depth``, ``num_heads``,
  ``spatial_merge_size``, ``window_size`` and ``fullatt_block_indexes``;
- Llama 3.2 Vision (mllama): ``text_config`` with ``cross_attention_layers``, ``vision_config``
  with ``num_global_layers``, ``max_num_tiles`` and ``vision_output_dim``;
- InternVL (internvl_chat): ``llm_config``, ``vision_config`` (InternViT), ``downsample_ratio``
  and ``max_dynamic_patch`` (+ a thumbnail);
- LLaVA, LLaVA-NeXT, LLaVA-OneVision (llava*): ``text_config``, ``vision_config`` (CLIP or
  SigLIP), ``image_grid_pinpoints``.
"""

from __future__ import annotations

import math
from typing import Any

from aihpc.runspec import SpecError

__all__ = ["hf_vision", "is_vlm_config"]

_MAX_PIXELS = 12845056  # Qwen2-VL / Qwen2.5-VL preprocessor_config.json's max_pixels


def is_vlm_config(config: dict[str, Any]) -> bool:
    return isinstance(config.get("vision_config"), dict)


def _int(table: dict[str, Any], key: str, where: str, default: Any = None) -> int:
    value = table.get(key, default)
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value != int(value) or value <= 0:
        raise SpecError(f"{where} {key}", value, "expected an integer > 0")
    return int(value)


def _llm_config(config: dict[str, Any]) -> dict[str, Any]:
    for key in ("llm_config", "text_config"):
        sub = config.get(key)
        if isinstance(sub, dict) and "hidden_size" in sub:
            return sub
    return config


def hf_vision(
    config: dict[str, Any], where: str = "CONFIG"
) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(the language model's config, the [model.vision] table, notes) of a VLM config.json."""
    llm = _llm_config(config)
    vc = config["vision_config"]
    kind = str(config.get("model_type") or "")
    w = f"{where} vision_config"
    if kind.startswith("qwen2") or "fullatt_block_indexes" in vc or "depth" in vc:
        return llm, _qwen(vc, w), f"max_pixels = {_MAX_PIXELS} (the preprocessor's default)"
    if kind == "mllama" or "max_num_tiles" in vc:
        return llm, _mllama(vc, llm, w), ""
    if kind == "internvl_chat" or "downsample_ratio" in config:
        return llm, _internvl(config, vc, llm, w), ""
    return llm, _llava(config, vc, llm, w), ""


def _qwen(vc: dict[str, Any], w: str) -> dict[str, Any]:
    patch = _int(vc, "patch_size", w, 14)
    hidden = _int(vc, "hidden_size", w)
    merge = _int(vc, "spatial_merge_size", w, 2)
    window = vc.get("window_size")
    full = vc.get("fullatt_block_indexes")
    out: dict[str, Any] = {
        "num_layers": _int(vc, "depth", w),
        "hidden_size": hidden,
        "num_attention_heads": _int(vc, "num_heads", w),
        "ffn_hidden_size": _int(vc, "intermediate_size", w, 4 * hidden),
        "ffn_activation": "swiglu" if vc.get("hidden_act") == "silu" else "gelu",
        "patch_size": patch,
        "resolution": "native",
        "max_pixels": _MAX_PIXELS,
        "attention_scope": "image",
        "merge": merge,
        "projector_hidden": hidden * merge * merge,
    }
    if window is not None and isinstance(full, list):  # Qwen2.5-VL's window attention
        out["window_patches"] = (_int(vc, "window_size", w) // patch) ** 2
        out["full_attention_layers"] = len(full)
    return out


def _mllama(vc: dict[str, Any], llm: dict[str, Any], w: str) -> dict[str, Any]:
    hidden = _int(vc, "hidden_size", w)
    cross = llm.get("cross_attention_layers") or []
    if not isinstance(cross, list):
        raise SpecError(f"{w} cross_attention_layers", cross, "expected a list of layer indices")
    dim = _int(vc, "vision_output_dim", w, hidden)
    return {
        "num_layers": _int(vc, "num_hidden_layers", w) + int(vc.get("num_global_layers") or 0),
        "hidden_size": hidden,
        "num_attention_heads": _int(vc, "attention_heads", w, vc.get("num_attention_heads")),
        "ffn_hidden_size": _int(vc, "intermediate_size", w),
        "patch_size": _int(vc, "patch_size", w),
        "image_size": _int(vc, "image_size", w),
        "max_tiles": _int(vc, "max_num_tiles", w, 4),
        "class_tokens": 1,
        "attention_scope": "image",
        "feature_layers": max(1, dim // hidden),
        "cross_attention_layers": len(cross),
    }


def _internvl(
    config: dict[str, Any], vc: dict[str, Any], llm: dict[str, Any], w: str
) -> dict[str, Any]:
    ratio = config.get("downsample_ratio", 0.5)
    if not isinstance(ratio, int | float) or isinstance(ratio, bool) or not 0 < ratio <= 1:
        raise SpecError(f"{w.rsplit(' ', 1)[0]} downsample_ratio", ratio, "a number in (0, 1]")
    tiles = _int(config, "max_dynamic_patch", w.rsplit(" ", 1)[0], 12)
    return {
        "num_layers": _int(vc, "num_hidden_layers", w),
        "hidden_size": _int(vc, "hidden_size", w),
        "num_attention_heads": _int(vc, "num_attention_heads", w),
        "ffn_hidden_size": _int(vc, "intermediate_size", w),
        "patch_size": _int(vc, "patch_size", w),
        "image_size": _int(config, "force_image_size", w, vc.get("image_size")),
        "max_tiles": tiles + (1 if config.get("use_thumbnail") else 0),
        "class_tokens": 1,
        "merge": max(1, round(1 / ratio)),
        "projector_hidden": _int(llm, "hidden_size", "CONFIG llm_config"),
    }


def _llava(
    config: dict[str, Any], vc: dict[str, Any], llm: dict[str, Any], w: str
) -> dict[str, Any]:
    size = _int(vc, "image_size", w, 336)
    grid = config.get("image_grid_pinpoints")
    tiles = 1
    if isinstance(grid, list) and grid:  # AnyRes: the largest grid's tiles and the base image
        areas = [
            g[0] * g[1]
            for g in grid
            if isinstance(g, list) and len(g) == 2 and all(isinstance(x, int) for x in g)
        ]
        if areas:
            tiles = max(areas) // (size * size) + 1
    cap = str(config.get("vision_aspect_ratio") or "")
    if cap.startswith("anyres_max_") and cap.removeprefix("anyres_max_").isdigit():
        tiles = min(tiles, int(cap.removeprefix("anyres_max_")) + 1)  # the cap and the base image
    clip = "clip" in str(vc.get("model_type", "clip"))
    return {
        "num_layers": _int(vc, "num_hidden_layers", w, 24),
        "hidden_size": _int(vc, "hidden_size", w, 1024),
        "num_attention_heads": _int(vc, "num_attention_heads", w, 16),
        "ffn_hidden_size": _int(vc, "intermediate_size", w, 4096),
        "patch_size": _int(vc, "patch_size", w, 14),
        "image_size": size,
        "max_tiles": tiles,
        "class_tokens": 1 if clip else 0,
        "projector_hidden": _int(llm, "hidden_size", "CONFIG text_config"),
    }
