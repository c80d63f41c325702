"""The inference estimate's terms: each follows its physics (more batch, more context, more
bytes per element cost more; FP8 KV halves the cache; MLA caches its latent), and bad input is
one SpecError naming the field."""

from __future__ import annotations

import dataclasses

import pytest

from aihpc.perf.infer import estimate_inference, kv_bytes_per_token
from aihpc.perf.infer.kv import ServingPlan
from aihpc.runspec import SpecError
from aihpc.runspec.cluster import GPUSpec, gpu_from_id
from aihpc.runspec.model import model_from_table

LLAMA = model_from_table({"preset": "llama3-70b"})
DSV3 = model_from_table({"preset": "deepseek-v3"})
H100 = gpu_from_id("h100-sxm")


def est(**kw):
    args = {"batch": 32, "prompt_len": 1024, "output_len": 256, "tp": 8}
    return estimate_inference(LLAMA, H100, **{**args, **kw})


def test_decode_step_grows_with_batch_and_context_and_throughput_with_batch() -> None:
    small, big = est(batch=8), est(batch=128)
    assert small.tpot_s < big.tpot_s
    assert small.tokens_per_s_per_gpu < big.tokens_per_s_per_gpu
    assert est(prompt_len=512).tpot_s < est(prompt_len=8192).tpot_s
    assert est(prompt_len=512).prefill_s < est(prompt_len=2048).prefill_s


def test_small_batch_decode_is_weight_read_bound() -> None:
    e = est(batch=1)
    weights = e.memory.weights * (1 << 30)
    floor = weights / (H100.hbm_bw_GBps * 1e9)  # every weight read once, at the peak
    assert e.tpot_s > floor
    assert "weight reads" in e.bottleneck


def test_fp8_kv_halves_the_cache_and_gqa_splits_over_tp() -> None:
    bf16 = kv_bytes_per_token(LLAMA, ServingPlan(tp=8))
    fp8 = kv_bytes_per_token(LLAMA, ServingPlan(tp=8, kv_dtype="fp8"))
    assert fp8 == pytest.approx(bf16 / 2)
    one = kv_bytes_per_token(LLAMA, ServingPlan(tp=1))
    assert one == pytest.approx(2 * LLAMA.kv_heads * LLAMA.kv_channels * LLAMA.num_layers * 2)
    assert bf16 == pytest.approx(one / 8)  # 8 KV heads, one per rank
    # past the KV heads, each rank keeps a replica of one head
    assert kv_bytes_per_token(LLAMA, ServingPlan(tp=16)) == pytest.approx(bf16)


def test_mla_caches_the_latent_and_rope_key_on_every_tp_rank() -> None:
    want = (DSV3.kv_lora_rank + DSV3.qk_rope_head_dim) * DSV3.num_layers * 2
    assert kv_bytes_per_token(DSV3, ServingPlan(tp=1)) == pytest.approx(want)
    assert kv_bytes_per_token(DSV3, ServingPlan(tp=8)) == pytest.approx(want)


def test_max_batch_is_what_the_kv_capacity_holds() -> None:
    e = est(batch=16)
    m = e.memory
    pages = -(-(1024 + 256) // 16) * 16
    assert m.max_batch == int(m.kv_capacity_tokens // pages)
    assert m.fits
    too_many = est(batch=m.max_batch + 64)
    assert not too_many.memory.fits
    assert "does not fit" in too_many.bottleneck
    assert est(batch=16, kv_dtype="fp8").memory.max_batch > m.max_batch


def test_large_ep_decode_prices_the_low_latency_all_to_all() -> None:
    h800 = gpu_from_id("h800")
    kw = {"batch": 144 * 32, "prompt_len": 2048, "output_len": 512, "weight_dtype": "fp8"}
    e = estimate_inference(DSV3, h800, dp=144, ep=144, **kw)
    assert e.decode.terms()["ep_comm"] > 0
    assert e.memory.fits
    # the same batch on fewer, larger EP groups: a different all-to-all, same model
    e32 = estimate_inference(DSV3, h800, dp=32, ep=32, **{**kw, "batch": 32 * 32})
    assert e32.decode.terms()["ep_comm"] > 0


def test_a_host_spec_prices_eager_ops_on_the_host() -> None:
    cpu = GPUSpec(
        bf16_tflops=0.1,
        fp32_tflops=0.1,
        hbm_gib=8,
        hbm_bw_GBps=20,
        scale_up_bw_GBps=5,
        scale_up_domain=1,
        scale_out_bw_GBps=5,
        gpus_per_node=1,
        gemm_efficiency=1.0,
        host_is_device=True,
    )
    tiny = model_from_table({"preset": "tiny-llama-small"})
    e = estimate_inference(tiny, cpu, batch=2, prompt_len=64, output_len=16, act_dtype="fp32")
    assert 0 < e.decode_step_s < e.prefill_s
    assert e.decode.terms()["launches"] > 0


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"batch": 0}, "inference.batch"),
        ({"tp": 0}, "inference.tp"),
        ({"ep": 2}, "inference.ep"),  # a dense model
        ({"kv_dtype": "int3"}, "inference.kv_dtype"),
        ({"weight_dtype": "fp4x"}, "inference.weight_dtype"),
        ({"gpu_memory_utilization": 1.5}, "inference.gpu_memory_utilization"),
    ],
)
def test_bad_input_is_one_line_naming_the_field(kw: dict, field: str) -> None:
    with pytest.raises(SpecError) as err:
        est(**kw)
    assert str(err.value).startswith(field)
    assert "\n" not in str(err.value)


def test_a_cluster_spec_brings_its_calibration() -> None:
    from pathlib import Path

    from aihpc.runspec import load_runspec

    root = Path(__file__).resolve().parents[3]
    spec = load_runspec(root / "examples" / "llama3-70b-calibrated.toml")
    assert spec.cluster.calibration is not None
    kw = {"batch": 32, "prompt_len": 1024, "output_len": 128, "tp": 8}
    calibrated = estimate_inference(spec.model, spec.cluster, **kw)
    catalog = estimate_inference(spec.model, spec.cluster.gpu, **kw)
    assert calibrated.prefill_s != catalog.prefill_s  # its measured GEMM table prices them
    plain = dataclasses.replace(spec.cluster, calibration=None)
    same = estimate_inference(spec.model, plain, **kw)
    assert same.prefill_s == pytest.approx(catalog.prefill_s)
