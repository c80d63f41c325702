"""What ``aihpc estimate`` reports beside the priced figures (issue 34): the parameters (total,
active, per stage, per GPU) against published counts, the communication hidden behind compute
(priced, moved out of the step, never dropped), the peak MFU is quoted on, the memory headroom,
and the goodput ranking over arrays against the ranking of each plan's own estimate."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aihpc.cli import app
from aihpc.goodput.ettr import ettr_of_step_time
from aihpc.perf.search.ranking import search
from aihpc.perf.step.estimate import estimate
from aihpc.runspec import load_runspec, runspec_from_dict
from aihpc.runspec.cluster import gpu_from_id
from aihpc.runspec.errors import SpecError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _spec(preset: str, gpu: str = "h100-sxm", **parallel: object) -> object:
    table = {"global_batch_size": 64, **parallel}
    return runspec_from_dict(
        {
            "model": {"preset": preset},
            "cluster": {"gpu": gpu, "num_gpus": 64},
            "parallel": table,
        }
    )


@pytest.mark.parametrize(
    ("preset", "total_B", "active_B"),
    [
        ("llama3-8b", 8.03, 8.03),  # Meta's model card: 8.03B
        ("deepseek-v3", 671, 37),  # DeepSeek-V3 report: 671B total, 37B activated per token
        ("mixtral-8x7b", 46.7, 12.9),  # Mistral AI: 46.7B total, 12.9B active
    ],
)
def test_parameters_match_the_published_counts(
    preset: str, total_B: float, active_B: float
) -> None:
    spec = _spec(preset, tp=8, pp=8, ep=8 if "deepseek" in preset or "mixtral" in preset else 1)
    p = estimate(spec).params
    assert p.total / 1e9 == pytest.approx(total_B, rel=0.01)
    assert p.active / 1e9 == pytest.approx(active_B, rel=0.03)


def test_stages_add_up_to_the_model_and_a_gpu_holds_its_tensor_parallel_share() -> None:
    spec = _spec("llama3-70b", tp=8, pp=4)  # 80 layers: 20 a stage
    p = estimate(spec).params
    m = spec.model
    layer = (p.total - 2 * m.vocab_size * m.hidden_size - m.hidden_size) / m.num_layers
    assert p.first_stage + p.last_stage + 2 * 20 * layer == pytest.approx(p.total, rel=1e-12)
    embedding = m.vocab_size * m.hidden_size
    assert p.per_gpu == pytest.approx((20 * layer + embedding) / 8, rel=1e-9)


def test_experts_split_over_ep_in_the_per_gpu_count() -> None:
    one = estimate(_spec("mixtral-8x7b", tp=1, pp=8, ep=1)).params
    eight = estimate(_spec("mixtral-8x7b", tp=1, pp=8, ep=8)).params
    assert eight.per_gpu < one.per_gpu / 3  # the experts are most of a Mixtral layer
    assert (eight.total, eight.first_stage) == (one.total, one.first_stage)


def test_a_hidden_all_to_all_is_priced_and_moved_out_of_the_step() -> None:
    """DualPipe hides the expert-parallel all-to-all: what the table no longer shows is the
    hidden share of the same all-to-all a plan without overlap exposes."""
    spec = load_runspec(EXAMPLES / "deepseek-v3-h800.toml")
    dual = estimate(spec)
    plain = estimate(spec, dataclasses.replace(spec.plan(), moe_a2a_overlap="none"))
    assert dual.time_s["ep_comm"] == 0.0 < dual.hidden_s["ep_comm"]
    assert plain.hidden_s["ep_comm"] == 0.0 < plain.time_s["ep_comm"]
    total = dual.time_s["ep_comm"] + dual.hidden_s["ep_comm"]
    assert total == pytest.approx(plain.time_s["ep_comm"], rel=1e-9)


def test_the_text_says_what_was_hidden_and_on_which_peak_mfu_is() -> None:
    out = CliRunner().invoke(app, ["estimate", str(EXAMPLES / "deepseek-v3-h800.toml")])
    assert "hidden behind compute (not in the step): expert-parallel all-to-all" in out.output
    assert "(dualpipe overlap)" in out.output
    assert "of the FP8 dense peak, 1,979 TFLOP/s" in out.output
    assert "of the BF16 peak, Megatron's and NeMo's basis" in out.output
    assert "671.03 B total · 37.55 B active per token" in out.output


def test_mfu_names_its_peak_and_gives_the_bf16_one_for_fp8() -> None:
    h100 = gpu_from_id("h100-sxm")
    fp8 = estimate(load_runspec(EXAMPLES / "deepseek-v3-h800.toml")).to_json()
    assert fp8["mfu_peak"] == {"precision": "fp8", "tflops": gpu_from_id("h800").fp8_tflops}
    ratio = gpu_from_id("h800").fp8_tflops / gpu_from_id("h800").bf16_tflops
    assert fp8["mfu_bf16_peak"] == pytest.approx(fp8["mfu"] * ratio, rel=1e-12)
    bf16 = estimate(load_runspec(EXAMPLES / "llama3-70b.toml")).to_json()
    assert bf16["mfu_peak"] == {"precision": "bf16", "tflops": h100.bf16_tflops}
    assert bf16["mfu_bf16_peak"] == pytest.approx(bf16["mfu"], rel=1e-12)


def test_headroom_decides_the_fit_and_the_search() -> None:
    spec = load_runspec(EXAMPLES / "llama3-70b.toml")
    est = estimate(spec)
    free = est.hbm_gib - est.memory.total / 2**30
    keep = dataclasses.replace(spec.cluster, memory_headroom_gib=free + 0.1)
    assert est.fits and not estimate(dataclasses.replace(spec, cluster=keep)).fits
    searched = load_runspec(EXAMPLES / "llama3-70b-search.toml")
    tight = dataclasses.replace(
        searched, cluster=dataclasses.replace(searched.cluster, memory_headroom_gib=12.0)
    )
    loose_result, tight_result = search(searched, top=50), search(tight, top=50)
    assert tight_result.feasible < loose_result.feasible
    assert all(e.memory.total / 2**30 <= e.hbm_gib - 12.0 for e in tight_result.plans)
    assert loose_result.plans[0].memory.total / 2**30 > tight_result.plans[0].hbm_gib - 12.0


def test_headroom_from_the_command_line_and_its_bad_values() -> None:
    runner = CliRunner()
    path = str(EXAMPLES / "llama3-70b.toml")
    out = runner.invoke(app, ["estimate", path, "--headroom-gib", "40"])
    assert out.exit_code == 1 and "does NOT fit with 40 GiB kept free" in out.output
    for bad in ("-1", "80"):
        out = runner.invoke(app, ["estimate", path, "--headroom-gib", bad])
        assert out.exit_code == 2
        assert "--headroom-gib" in out.output and "below the GPU's 79.6" in out.output
    with pytest.raises(SpecError, match=r"cluster\.memory_headroom_gib"):
        runspec_from_dict(
            {
                "model": {"preset": "llama3-8b"},
                "cluster": {"gpu": "h100-sxm", "num_gpus": 8, "memory_headroom_gib": 100},
                "parallel": {"global_batch_size": 8},
            }
        )


def test_goodput_ranking_over_arrays_is_the_ranking_of_each_estimate() -> None:
    """``weight`` ranks by throughput x weight(step time) over the arrays: the order a key on
    each plan's own estimate gives, for ETTR and for a weight that reorders the plans."""
    spec = load_runspec(EXAMPLES / "llama3-70b-search.toml")
    ettr_at = ettr_of_step_time(spec)

    def shuffled(step_time_s: float) -> float:  # not monotone in the step: reorders the plans
        return 2.0 if (step_time_s * 1000) % 2 < 1 else 1.0

    throughput = [e.plan for e in search(spec, top=25).plans]
    for weight in (ettr_at, shuffled):
        by_weight = search(spec, top=25, weight=weight)
        by_estimate = search(
            spec, top=25, key=lambda e, w=weight: e.tokens_per_s_per_gpu * w(e.step_time_s)
        )
        assert [e.plan for e in by_weight.plans] == [e.plan for e in by_estimate.plans]
    assert [e.plan for e in by_weight.plans] != throughput


def test_a_batch_that_does_not_divide_over_the_default_dp_says_where_dp_came_from() -> None:
    spec = {
        "model": {"preset": "llama3-405b"},
        "cluster": {"gpu": "h100-sxm", "num_gpus": 16384},
        "parallel": {"global_batch_size": 2048, "tp": 2},
    }
    with pytest.raises(SpecError) as err:
        runspec_from_dict(spec).plan()
    text = str(err.value)
    assert "dp 8192 is num_gpus 16384 / (tp 2, pp 1 by default, cp 1 by default)" in text
    assert "aihpc search RUN.toml -o plan.toml" in text
    assert json.dumps(text)


def test_a_plan_searched_with_headroom_keeps_it_in_the_file(tmp_path: Path) -> None:
    out = tmp_path / "plan.toml"
    spec = str(EXAMPLES / "llama3-70b-search.toml")
    res = CliRunner().invoke(app, ["search", spec, "--headroom-gib", "12", "-o", str(out)])
    assert res.exit_code == 0, res.output
    written = load_runspec(out)
    assert written.cluster.memory_headroom_gib == 12
    assert estimate(written).memory.total / 2**30 <= written.cluster.usable_hbm_gib
