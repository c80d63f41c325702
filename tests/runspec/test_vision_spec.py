"""[model.vision] and [multimodal] (issue 40): the VLM presets, the distributions of the data
fact, and bad input refused in one line naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aihpc.interop.hf.reader import import_hf
from aihpc.runspec import SpecError, runspec_from_dict
from aihpc.runspec.vision import distribution_from, vlm_presets

HF = Path(__file__).resolve().parents[2] / "examples" / "vlm" / "hf"


def _spec(model: dict, mm: dict | None = None):  # type: ignore[no-untyped-def]
    data = {"model": model, "cluster": {"gpu": "h100-sxm", "num_gpus": 8}}
    if mm is not None:
        data["multimodal"] = mm
    return runspec_from_dict(data)


@pytest.mark.parametrize("name", sorted(vlm_presets()))
def test_every_vlm_preset_loads_with_a_source(name: str) -> None:
    spec = _spec({"preset": name})
    assert spec.vision is not None and spec.multimodal is not None
    assert spec.model.name == name and len(vlm_presets()[name]["source"]) > 40
    assert spec.vision.max_image_tokens > 0


# Each preset beside the config.json its repository publishes, read by `aihpc import hf`: two
# transcriptions of the same numbers that must agree field by field.
PAIRS = [
    ("qwen2.5-vl-7b", "qwen2.5-vl-7b-instruct.json"),
    ("qwen2.5-vl-72b", "qwen2.5-vl-72b-instruct.json"),
    ("qwen2.5-vl-3b", "qwen2.5-vl-3b-instruct.json"),
    ("llama3.2-vision-11b", "llama-3.2-11b-vision.json"),
    ("llama3.2-vision-90b", "llama-3.2-90b-vision.json"),
    ("internvl2.5-8b", "internvl2.5-8b.json"),
    ("internvl2.5-78b", "internvl2.5-78b.json"),
    ("llava-onevision-7b", "llava-onevision-qwen2-7b-ov.json"),
    ("qwen3-vl-4b", "qwen3-vl-4b-instruct.json"),
]


@pytest.mark.parametrize(("preset", "config"), PAIRS)
def test_presets_match_the_published_config_json(preset: str, config: str) -> None:
    path = HF / config
    imported = import_hf(path.read_text(), str(path), seq_length=4096).spec()
    spec = _spec({"preset": preset})
    assert imported.vision is not None and spec.vision is not None
    for f in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size"):
        assert getattr(imported.vision, f) == getattr(spec.vision, f), f
        assert getattr(imported.model, f) == getattr(spec.model, f), f
    for f in ("patch_size", "merge", "window_patches", "full_attention_layers", "max_tiles"):
        assert getattr(imported.vision, f) == getattr(spec.vision, f), f
    assert imported.vision.tokens_per_tile == spec.vision.tokens_per_tile
    assert imported.vision.cross_attention_layers == spec.vision.cross_attention_layers
    assert imported.model.kv_heads == spec.model.kv_heads


def test_buckets_are_normalised_and_a_number_is_a_point() -> None:
    d = distribution_from("x", {"values": [0, 1, 2], "weights": [1, 2, 1]})
    assert d.weights == (0.25, 0.5, 0.25) and d.mean == pytest.approx(1.0)
    assert distribution_from("x", 576).values == (576.0,)


def test_mean_and_p99_give_a_lognormal_with_that_mean_and_tail() -> None:
    d = distribution_from("x", {"mean": 1000, "p99": 5000})
    assert d.mean == pytest.approx(1000, rel=1e-9)
    top = sorted(d.values)
    # 64 equal-probability points: the last is the 99.2th percentile, the one before 97.7th
    assert top[-2] < 5000 < top[-1]


@pytest.mark.parametrize(
    ("mm", "field"),
    [
        ({"images_per_sample": {"values": [1, 2], "weights": [1]}}, "images_per_sample.weights"),
        ({"images_per_sample": {"values": [1.5], "weights": [1]}}, "images_per_sample.values"),
        ({"image_tokens": -3}, "image_tokens"),
        ({"image_tokens": {"mean": 100, "p99": 50}}, "image_tokens.p99"),
        ({"text_tokens": "many"}, "text_tokens"),
        ({"placement": "gpu0"}, "multimodal.placement"),
        ({"padding": "some"}, "multimodal.padding"),
        ({"freeze_llm": "yes"}, "multimodal.freeze_llm"),
    ],
)
def test_bad_multimodal_names_the_field(mm: dict, field: str) -> None:
    with pytest.raises(SpecError) as err:
        _spec({"preset": "llava-1.5-7b"}, mm)
    assert field in str(err.value) and "\n" not in str(err.value)


def test_multimodal_needs_a_vision_encoder() -> None:
    with pytest.raises(SpecError, match="multimodal"):
        _spec({"preset": "llama3-8b"}, {"image_tokens": 576})


def test_a_vision_table_on_a_text_preset_and_its_overrides() -> None:
    clip = {"num_layers": 24, "hidden_size": 1024, "num_attention_heads": 16}
    clip |= {"ffn_hidden_size": 4096, "patch_size": 14, "image_size": 336, "class_tokens": 1}
    spec = _spec({"preset": "llama3-8b", "vision": clip})
    assert spec.vision is not None and spec.vision.patches_per_tile == 577
    over = _spec({"preset": "qwen2.5-vl-7b", "vision": {"full_attention_layers": 8}})
    assert over.vision is not None and over.vision.full_attention_layers == 8
    with pytest.raises(SpecError, match=r"model\.vision\.num_attention_heads"):
        _spec({"preset": "llama3-8b", "vision": {**clip, "num_attention_heads": 15}})


def test_multimodal_round_trips_as_json_tables() -> None:
    spec = _spec(
        {"preset": "qwen2.5-vl-7b"}, {"image_tokens": {"values": [256, 1024], "weights": [3, 1]}}
    )
    assert spec.multimodal is not None
    table = spec.multimodal.to_table()
    json.dumps(table)
    again = _spec({"preset": "qwen2.5-vl-7b"}, table)
    assert again.multimodal == spec.multimodal
