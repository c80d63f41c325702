"""The data loader's host time (perf/multimodal/loader.py) from its definition: per step and
rank, samples x (images x (decode + process) x pixels + text tokens x tokenizer seconds), all of
it with no DataLoader workers, one worker's share beyond the step with them; the figures read
back from their CSV, each with its source."""

from __future__ import annotations

import csv
from importlib import resources

import pytest

from aihpc.perf.fit.vlm_validate import row_spec
from aihpc.perf.multimodal import estimate_vlm
from aihpc.perf.multimodal.loader import (
    image_pixels,
    loader_figures,
    loader_s,
    loader_step_s,
    loader_visible_s,
)
from aihpc.runspec import SpecError, runspec_from_dict
from aihpc.runspec.vision import IMAGE_PROCESSORS


def _rows() -> list[dict[str, str]]:
    path = resources.files("aihpc.perf.multimodal").joinpath("data/loader_figures.csv")
    with path.open(encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def _per(kind: str, processor: str = "") -> float:
    for r in _rows():
        if r["kind"] == kind and r["processor"] == processor:
            return float(r["value"]) / float(r["per"])
    raise AssertionError(f"no {kind} row for {processor!r}")


def _spec(preset: str, mm: dict, parallel: dict | None = None):  # type: ignore[no-untyped-def]
    return runspec_from_dict(
        {
            "model": {"preset": preset},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 8},
            "parallel": parallel or {"dp": 8, "micro_batch_size": 2, "global_batch_size": 32},
            "multimodal": {"packing": False, "placement": "replicated", **mm},
        }
    )


def test_every_figure_names_its_source_and_every_processor_has_one() -> None:
    rows = _rows()
    assert all(len(r["source"]) > 40 for r in rows)
    processors = {r["processor"] for r in rows if r["kind"] == "processor"}
    assert processors == set(IMAGE_PROCESSORS) - {"none"}


def test_loader_seconds_follow_the_definition_native_and_tiles() -> None:
    decode, text = _per("decode"), _per("text") * _per("text_bytes")
    for preset, tokens, pixels in (
        ("qwen3-vl-4b", 300, 300 * 2 * 2 * 16 * 16),  # native: tokens x merge^2 x patch^2
        ("internvl3.5-4b", 600, 3 * 448 * 448),  # tiles: 600 tokens = 3 tiles of 256 (ceil)
    ):
        for proc in ("hf-torchvision", "hf-pil"):
            spec = _spec(
                preset,
                {
                    "images_per_sample": 2,
                    "image_tokens": tokens,
                    "text_tokens": 50,
                    "image_processor": proc,
                },
            )
            assert spec.vision is not None and spec.multimodal is not None
            assert image_pixels(spec.vision, tokens) == pixels
            want = 3 * (2 * (decode + _per("processor", proc)) * pixels + 50 * text)
            assert loader_s(spec.vision, spec.multimodal, 3) == pytest.approx(want, rel=1e-12)


def test_the_step_waits_for_the_slowest_rank() -> None:
    """Images a sample 0 to 3 (mean 1.5): one rank is its expected maximum over the ranks,
    between the mean and four rank-samples of three images each."""
    mm = {"images_per_sample": {"values": [0, 3], "weights": [0.5, 0.5]}, "image_tokens": 300}
    spec = _spec("qwen3-vl-4b", {**mm, "text_tokens": 0, "image_processor": "hf-torchvision"})
    v, m = spec.vision, spec.multimodal
    assert v is not None and m is not None
    one = (_per("decode") + _per("processor", "hf-torchvision")) * image_pixels(v, 300)
    assert loader_s(v, m, 4) == pytest.approx(4 * 1.5 * one, rel=1e-9)
    assert loader_step_s(v, m, 4, 1) == pytest.approx(loader_s(v, m, 4), rel=1e-9)
    slow = [loader_step_s(v, m, 4, r) for r in (2, 8, 64)]
    assert loader_s(v, m, 4) < slow[0] < slow[1] < slow[2] <= 4 * 3 * one * (1 + 1e-9)


def test_no_processor_prices_no_loader() -> None:
    spec = _spec("qwen3-vl-4b", {"image_tokens": 300})
    assert spec.vision is not None and spec.multimodal is not None
    assert loader_s(spec.vision, spec.multimodal, 4) == 0.0
    assert "data_loader" not in estimate_vlm(spec).time_s


def test_workers_hide_the_loader_up_to_the_step() -> None:
    assert loader_visible_s(0.3, 0, 1.0) == 0.3  # in the training process: all of it
    assert loader_visible_s(0.3, 2, 1.0) == 0.0  # 0.15 a worker, under the step
    assert loader_visible_s(3.0, 2, 1.0) == pytest.approx(0.5)  # 1.5 a worker, 0.5 beyond


@pytest.mark.parametrize("workers", [0, 4])
def test_the_estimate_adds_what_shows(workers: int) -> None:
    mm = {"images_per_sample": 1, "image_tokens": 1200, "text_tokens": 40}
    base = estimate_vlm(_spec("qwen3-vl-4b", mm))
    spec = _spec("qwen3-vl-4b", {**mm, "image_processor": "hf-pil", "loader_workers": workers})
    est = estimate_vlm(spec)
    assert spec.vision is not None and spec.multimodal is not None
    host = loader_s(spec.vision, spec.multimodal, 32 // 8)  # the global batch over dp
    shown = loader_visible_s(host, workers, base.step_time_s)
    assert est.time_s["data_loader"] == pytest.approx(shown, rel=1e-12)
    assert est.step_time_s == pytest.approx(base.step_time_s + shown, rel=1e-12)
    assert (shown > 0) == (workers == 0)


def test_bad_loader_facts_name_their_field() -> None:
    with pytest.raises(SpecError, match=r"multimodal\.image_processor"):
        _spec("qwen3-vl-4b", {"image_processor": "opencv"})
    with pytest.raises(SpecError, match=r"multimodal\.loader_workers"):
        _spec("qwen3-vl-4b", {"loader_workers": -1})
    row = {"vlm": "qwen3-vl-4b", "gpu": "h100-sxm", "num_gpus": "8", "loader_workers": "two"}
    row |= {"images_per_sample": "1", "image_tokens": "575", "text_tokens_mean": "32"}
    row |= {"text_tokens_p99": "40"}
    with pytest.raises(SpecError, match="loader_workers"):
        row_spec(row)


def test_figures_are_per_unit_rates_of_the_csv() -> None:
    f = loader_figures()
    assert f.decode_s_per_pixel == _per("decode")
    assert f.processor_s_per_pixel == {
        p: _per("processor", p) for p in ("hf-torchvision", "hf-pil")
    }
    assert f.text_s_per_token == _per("text") * _per("text_bytes")


def test_predecoded_images_cost_the_processor_alone() -> None:
    """A data set decoded before training (multimodal.predecoded) loads each step's images with
    no decode: samples x (images x processor x pixels + text), the decode's share gone."""
    mm = {"images_per_sample": 2, "image_tokens": 576, "text_tokens": 30}
    mm |= {"image_processor": "hf-torchvision"}
    decoded = _spec("qwen3-vl-4b", {**mm, "predecoded": True})
    fresh = _spec("qwen3-vl-4b", mm)
    v, m, m0 = decoded.vision, decoded.multimodal, fresh.multimodal
    assert v is not None and m is not None and m0 is not None
    pixels = image_pixels(v, 576)
    text = 30 * _per("text") * _per("text_bytes")
    want = 4 * (2 * _per("processor", "hf-torchvision") * pixels + text)
    assert loader_s(v, m, 4) == pytest.approx(want, rel=1e-12)
    gone = loader_s(v, m0, 4) - loader_s(v, m, 4)
    assert gone == pytest.approx(4 * 2 * _per("decode") * pixels, rel=1e-9)
    with pytest.raises(SpecError, match=r"multimodal\.predecoded"):
        _spec("qwen3-vl-4b", {**mm, "predecoded": "yes"})


def test_the_rows_that_build_their_data_set_as_a_list_are_predecoded() -> None:
    """NeMo AutoModel's make_rdr_dataset / make_medpix_dataset (A1, A3, A2) return a list read from
    a Hugging Face data set, so their images are decoded before the first step; the rows with a
    loader priced and another loader (S1's LLaVA workers read image files) are not."""
    path = resources.files("aihpc.perf.fit").joinpath("data/validation/vlm_step_runs.csv")
    with path.open(encoding="utf-8") as fh:
        rows = {r["id"]: r for r in csv.DictReader(fh)}
    flagged = {i for i, r in rows.items() if r["predecoded"] == "true"}
    assert flagged == {"A1", "A2", "A3"}
    for i in flagged:
        spec = row_spec(rows[i])
        assert spec.multimodal is not None and spec.multimodal.predecoded
        assert "make_" in rows[i]["note"] and "predecoded" in rows[i]["note"].lower()
    bad = {**rows["A1"], "predecoded": "maybe"}
    with pytest.raises(SpecError, match="predecoded"):
        row_spec(bad)


def test_megatron_mimo_rows_load_in_two_workers_and_the_step_hides_it() -> None:
    """M1 / M2 (Megatron-LM's mimo LLaVA runs): energon workers at Megatron's default
    --num-workers 2, each image decoded in a worker (not predecoded) and put through the
    torchvision-backed CLIP processor at 336 x 336. Serial seconds a step and data-parallel rank:
    its samples x ((decode + process) x pixels + text); one worker's half is under the step, so
    the estimate's data_loader term is 0."""
    path = resources.files("aihpc.perf.fit").joinpath("data/validation/vlm_step_runs.csv")
    with path.open(encoding="utf-8") as fh:
        rows = {r["id"]: r for r in csv.DictReader(fh)}
    per_pixel = _per("decode") + _per("processor", "hf-torchvision")
    text_s = _per("text") * _per("text_bytes")
    for rid, samples in (("M1", 128 // 8), ("M2", 128 // 4)):
        spec = row_spec(rows[rid])
        v, mm = spec.vision, spec.multimodal
        assert v is not None and mm is not None
        assert (mm.loader_workers, mm.predecoded, mm.image_processor) == (
            2,
            False,
            "hf-torchvision",
        )
        assert image_pixels(v, 576) == 336 * 336
        want = samples * (per_pixel * 336 * 336 + text_s * mm.text_tokens.mean)
        assert loader_step_s(v, mm, samples, spec.parallel.dp) == pytest.approx(want, rel=1e-9)
        est = estimate_vlm(spec)
        assert est.time_s["data_loader"] == 0.0
        assert want / 2 < est.step_time_s  # a worker's share is under the step
