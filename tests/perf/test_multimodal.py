"""The multimodal planner (issue 40): the encoder's parameters against published counts, its
FLOPs by a count of its own, the imbalance as an expected maximum (exact cases and the normal
limit), the five placements' accounting, and the search over them."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest

from aihpc.perf.multimodal import estimate_vlm
from aihpc.perf.multimodal.encoder import encoder_params, image_work, projector_params
from aihpc.perf.multimodal.estimate import frozen_llm_factor
from aihpc.perf.multimodal.imbalance import Grid, compound, expected_max
from aihpc.perf.multimodal.search import search_vlm
from aihpc.runspec import SpecError, runspec_from_dict
from aihpc.runspec.vision import Distribution


def _spec(preset: str, gpus: int = 64, parallel: dict | None = None, mm: dict | None = None):  # type: ignore[no-untyped-def]
    return runspec_from_dict(
        {
            "model": {"preset": preset},
            "cluster": {"gpu": "h100-sxm", "num_gpus": gpus},
            "parallel": parallel or {},
            "multimodal": mm or {},
        }
    )


# Published encoder sizes: OpenAI CLIP ViT-L/14's vision tower 303M (Radford et al. 2021,
# Table 19's ViT-L/14); Qwen2.5-VL's ViT with its merger into the 7B's width 675M (the
# Qwen2.5-VL technical report's Table 1; vLLM's Qwen2.5-VL recipe: "ViT 675M"); InternViT-6B
# 5.5B in its 45-layer V1.5 / V2.5 form (InternVL 1.5 drops the last 3 of its 48 blocks) and
# InternViT-300M 0.3B (the InternVL 2.5 report, Table 1).
@pytest.mark.parametrize(
    ("preset", "published", "with_projector"),
    [
        ("llava-1.5-7b", 303e6, False),
        ("qwen2.5-vl-7b", 675e6, True),
        ("internvl2.5-78b", 5.5e9, False),
        ("internvl2.5-8b", 0.3e9, False),
        ("internvl3.5-4b", 0.3e9, False),
    ],
)
def test_encoder_parameters_match_published_counts(
    preset: str, published: float, with_projector: bool
) -> None:
    spec = _spec(preset)
    assert spec.vision is not None
    n = encoder_params(spec.vision)
    if with_projector:
        n += projector_params(spec.vision, spec.model.hidden_size)
    assert n == pytest.approx(published, rel=0.02)


# Qwen3-4B, the language model of both 4B presets: "Number of Parameters (Non-Embedding): 3.6B"
# and 4.0B in all with its tied embedding (Qwen/Qwen3-4B model card). Its 32 heads of 128 are
# wider than its 2560 hidden (head_dim set apart): without head_dim the layers count 3.0B.
@pytest.mark.parametrize("preset", ["qwen3-vl-4b", "internvl3.5-4b"])
def test_the_4b_presets_language_model_has_qwen3_4b_s_published_size(preset: str) -> None:
    from aihpc.perf.step.flops import embedding_params, params_per_layer

    m = _spec(preset).model
    layers = params_per_layer(m) * m.num_layers
    assert layers == pytest.approx(3.6e9, rel=0.02)
    assert layers + embedding_params(m) == pytest.approx(4.0e9, rel=0.02)


def test_encoder_flops_by_a_count_of_its_own() -> None:
    """One CLIP tile: every layer's GEMMs (2 FLOPs a multiply-add per weight per token) and
    attention over all 577 tokens of the tile, no causal mask (4 h per query-key pair)."""
    spec = _spec("llava-1.5-7b")
    v = spec.vision
    assert v is not None
    w = image_work(v, 576)
    assert w.patches == 577 and w.lm_tokens == 576 and w.call_keys == 577
    h, f, n = 1024, 4096, 577
    per_layer = 2 * n * (4 * h * h + 2 * h * f) + 4 * h * n * n
    proj = 2 * 576 * (1024 * 4096 + 4096 * 4096)
    assert w.flops_fwd(v, 4096) == pytest.approx(24 * per_layer + proj, rel=1e-12)


def test_window_attention_cuts_the_pairs_of_the_windowed_layers() -> None:
    spec = _spec("qwen2.5-vl-7b")
    v = spec.vision
    assert v is not None
    w = image_work(v, 1024)  # 4,096 patches
    assert w.patches == 4096
    assert w.pairs == pytest.approx(4 * 4096**2 + 28 * 4096 * 64)
    tiled = image_work(_spec("internvl2.5-8b").vision, 1024)  # type: ignore[arg-type]
    assert tiled.patches == 4 * 1025 and tiled.pairs == pytest.approx(24 * 4 * 1025**2)


def test_grid_sums_keep_the_mean_and_the_variance() -> None:
    g = Grid.of([1.0, 2.0, 7.0], [0.5, 0.3, 0.2])
    mean, var = 0.5 + 0.6 + 1.4, 0.5 * 1 + 0.3 * 4 + 0.2 * 49 - 2.5**2
    s = g.times(300)
    assert s.mean == pytest.approx(300 * mean, rel=1e-9)
    assert s.std == pytest.approx(math.sqrt(300 * var), rel=0.01)


def test_expected_max_exact_small_cases() -> None:
    coin = Grid.of([0.0, 1.0], [0.5, 0.5])
    assert expected_max(coin, 1) == pytest.approx(0.5)
    assert expected_max(coin, 2) == pytest.approx(0.75)
    assert expected_max(coin, 3) == pytest.approx(0.875)
    assert expected_max(Grid.point(3.0), 64) == 3.0


def test_expected_max_of_a_sum_tends_to_the_normal_order_statistic() -> None:
    """Many samples per rank: the sum is near normal, and E[max of D] is mean + sigma times the
    expected maximum of D standard normals (integrated here on its own)."""
    g = Grid.of([0.0, 1.0, 4.0], [0.3, 0.5, 0.2])
    s = g.times(400)
    d = 64
    z = np.linspace(-8, 8, 20001)
    nd = NormalDist()
    pdf = np.array([nd.pdf(x) for x in z])
    cdf = np.array([nd.cdf(x) for x in z])
    e_max_z = float(np.trapezoid(z * d * pdf * cdf ** (d - 1), z))
    normal = s.mean + s.std * e_max_z
    assert expected_max(s, d) == pytest.approx(normal, rel=0.01)
    assert s.mean < expected_max(s, 8) < expected_max(s, 64) < expected_max(s, 512)


def test_compound_mixes_counts() -> None:
    count = Distribution((0.0, 2.0), (0.5, 0.5))
    item = Grid.of([1.0, 3.0], [0.5, 0.5])
    c = compound(count, item)
    assert c.mean == pytest.approx(0.5 * 2 * 2.0)
    assert expected_max(c, 1) == pytest.approx(c.mean)


def test_frozen_language_model_skips_the_weight_gradients() -> None:
    spec = _spec("llava-1.5-7b")
    f = frozen_llm_factor(spec, 2048)
    assert 2 / 3 < f < 1  # GEMMs alone 2/3; the attention core's backward is all input-gradient


MM = {
    "images_per_sample": {"values": [0, 1, 2, 4], "weights": [0.2, 0.5, 0.2, 0.1]},
    "image_tokens": {"mean": 1200, "p99": 6000},
    "text_tokens": {"mean": 600, "p99": 3000},
}
PLAN = {"tp": 4, "pp": 4, "dp": 4, "micro_batch_size": 1, "global_batch_size": 64}
PLAN |= {"sequence_parallel": True, "recompute": "selective"}


@pytest.mark.parametrize("where", ["replicated", "tp", "stage", "pool", "bubble"])
def test_each_placement_adds_its_terms_to_the_step(where: str) -> None:
    spec = _spec("qwen2.5-vl-7b", 64, PLAN, MM)
    e = estimate_vlm(spec, placement=where)
    assert e.step_time_s == pytest.approx(sum(e.time_s.values()))
    assert e.time_s["encoder_imbalance"] >= 0 and e.time_s["encoder"] >= 0
    llm = e.llm.plan
    assert llm.tp * llm.pp * llm.dp + e.encoder_gpus <= 64
    assert e.encoder_gpus > 0 if where in ("stage", "pool") else e.encoder_gpus == 0
    assert e.samples_per_s_per_gpu == pytest.approx(
        64 * e.layout.samples_per_seq / e.step_time_s / 64
    )


def test_imbalance_is_zero_for_fixed_images_and_grows_with_ranks() -> None:
    fixed = _spec("qwen2.5-vl-7b", 64, PLAN, {"image_tokens": 1024, "packing": False})
    flat = estimate_vlm(fixed, placement="tp").time_s["encoder_imbalance"]
    assert flat == pytest.approx(0, abs=1e-9)
    few = {**PLAN, "tp": 4, "pp": 8, "dp": 2}
    many = {**PLAN, "tp": 2, "pp": 2, "dp": 16}
    a = estimate_vlm(_spec("qwen2.5-vl-7b", 64, few, MM), placement="replicated")
    b = estimate_vlm(_spec("qwen2.5-vl-7b", 64, many, MM), placement="replicated")
    # the same encoder per micro-batch (replicated), 16 ranks' worst against 2 ranks'
    ratio_a = a.time_s["encoder_imbalance"] / a.time_s["encoder"]
    ratio_b = b.time_s["encoder_imbalance"] / b.time_s["encoder"]
    assert ratio_b > ratio_a


def test_a_frozen_encoder_costs_its_forward_only() -> None:
    trained = estimate_vlm(_spec("qwen2.5-vl-7b", 64, PLAN, MM), placement="tp")
    frozen = estimate_vlm(
        _spec("qwen2.5-vl-7b", 64, PLAN, {**MM, "freeze_encoder": True}), placement="tp"
    )
    assert frozen.time_s["encoder"] < trained.time_s["encoder"] / 2.5
    assert frozen.encoder_memory_gib < trained.encoder_memory_gib


def test_bubble_needs_a_pipeline() -> None:
    spec = _spec("qwen2.5-vl-7b", 64, {**PLAN, "pp": 1, "dp": 16}, MM)
    with pytest.raises(SpecError, match="pp >= 2"):
        estimate_vlm(spec, placement="bubble")


def test_cross_attention_models_keep_images_out_of_the_sequence() -> None:
    spec = _spec("llama3.2-vision-11b", 64, {**PLAN, "dp": 4}, {**MM, "packing": True})
    e = estimate_vlm(spec, placement="tp")
    assert e.time_s["cross_attention"] > 0
    # packed samples of text only: many more per sequence than if images took tokens
    assert e.layout.samples_per_seq >= 8192 // 3000


def test_search_covers_every_placement_and_ranks_what_fits() -> None:
    spec = _spec("qwen2.5-vl-7b", 64, {"global_batch_size": 128}, MM)
    r = search_vlm(spec, top=20, candidates=6)
    assert r.plans and all(e.fits for e in r.plans)
    rates = [e.samples_per_s_per_gpu for e in r.plans]
    assert rates == sorted(rates, reverse=True)
    assert {"replicated", "tp", "stage", "pool"} <= set(r.best_by_placement)
    assert r.plans[0].samples_per_s_per_gpu == max(
        e.samples_per_s_per_gpu for e in r.best_by_placement.values()
    )
