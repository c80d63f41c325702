"""Engine software facts (perf/infer/software.py, data/engines.toml) and the prefill physics of
expert-parallel engines: each fact changes the term it names and nothing else."""

from __future__ import annotations

import dataclasses
import math

import pytest

from aihpc.perf.infer.comm import moe_normal_s, remote_nodes_per_token, serving_cluster
from aihpc.perf.infer.estimate import engine_for, estimate_inference
from aihpc.perf.infer.kernels import Work, attention_decode_s, routed_experts_s
from aihpc.perf.infer.kv import ServingPlan
from aihpc.perf.infer.serving import Load, prefill_throughput
from aihpc.perf.infer.software import DEFAULT_SOFTWARE, engine_names, gpu_sms, software_for
from aihpc.perf.infer.step import StepTime, step_time
from aihpc.perf.infer.validate import load_rows, predict_row
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec import SpecError
from aihpc.runspec.cluster import gpu_from_id
from aihpc.runspec.inference import inference_from_table
from aihpc.runspec.model import model_from_table

LLAMA2_70B = model_from_table({"preset": "llama2-70b"})
LLAMA2_7B = model_from_table({"preset": "llama2-7b"})
DSV3 = model_from_table({"preset": "deepseek-v3"})
H100 = gpu_from_id("h100-sxm")
H800 = gpu_from_id("h800")


def test_every_engine_names_its_source_and_the_default_is_a_current_engine() -> None:
    names = engine_names()
    assert {"default", "trtllm-0.5", "sglang-ep", "deepseek"} <= set(names)
    assert software_for("default") == DEFAULT_SOFTWARE
    old = software_for("trtllm-0.5")
    assert not old.cuda_graphs and not old.gqa_grouped_decode
    assert software_for("deepseek").two_batch_overlap and software_for("deepseek").comm_sms > 0
    assert gpu_sms("h100-sxm") == gpu_sms("h800") == 132


@pytest.mark.parametrize(
    ("engine", "overrides", "field"),
    [
        ("vllm-9", {}, "inference.engine"),
        ("default", {"cuda_graphs": 1}, "inference.cuda_graphs"),
        ("default", {"comm_sms": -1}, "inference.comm_sms"),
        ("default", {"comm_sms": True}, "inference.comm_sms"),
        ("default", {"sms": 4}, "inference.sms"),
    ],
)
def test_a_bad_engine_or_fact_is_one_error_naming_the_field(
    engine: str, overrides: dict, field: str
) -> None:
    with pytest.raises(SpecError) as err:
        software_for(engine, **overrides)
    assert err.value.field == field


def test_a_row_overrides_one_fact_of_its_engine() -> None:
    sw = software_for("trtllm-0.5", cuda_graphs=True)
    assert sw.cuda_graphs and not sw.gqa_grouped_decode and sw.name == "trtllm-0.5"


def test_per_query_head_decode_reads_a_gqa_groups_cache_once_per_query_head() -> None:
    w = Work(decode_seqs=64, decode_ctx=3072)
    grouped = ServingPlan(tp=4, kv_dtype="fp8", weight_dtype="fp8")
    per_head = dataclasses.replace(grouped, software=software_for("trtllm-0.5"))
    e1, _ = engine_for(LLAMA2_70B, H100, grouped)
    e2, _ = engine_for(LLAMA2_70B, H100, per_head)
    group = LLAMA2_70B.num_attention_heads / LLAMA2_70B.kv_heads
    assert attention_decode_s(e2, w) == pytest.approx(group * attention_decode_s(e1, w), rel=1e-9)
    # multi-head attention has one query head per KV head: nothing to re-read
    e3, _ = engine_for(LLAMA2_7B, H100, ServingPlan(software=software_for("trtllm-0.5")))
    e4, _ = engine_for(LLAMA2_7B, H100, ServingPlan())
    assert attention_decode_s(e3, w) == pytest.approx(attention_decode_s(e4, w))


def test_two_batch_overlap_hides_the_shorter_side_and_computes_on_the_sms_left() -> None:
    share = 24 / 132
    e, cluster = engine_for(DSV3, H800, ServingPlan(dp=32, ep=32, weight_dtype="fp8"))
    added = step_time(e, cluster, Work(prefill_tokens=16384, prefill_keys=2048, prefill_len=4096))
    comm, work = added.tp_comm + added.ep_comm, added.compute.total
    assert added.total == pytest.approx(work + comm)
    over = dataclasses.replace(added, overlap_sm_share=share)
    # the compute stream runs on 108 of the 132 SMs for the whole overlapped forward
    assert over.total == pytest.approx(max(comm, work * 132 / 108))
    assert work * 132 / 108 > comm  # DeepSeek-V3's 4K prefill: compute-bound under overlap
    assert over.total < added.total
    slow_comm = dataclasses.replace(over, ep_comm=10 * work)
    assert slow_comm.total == pytest.approx(slow_comm.ep_comm + slow_comm.tp_comm)


def test_only_prefill_steps_of_an_overlapping_ep_engine_overlap() -> None:
    plan = ServingPlan(dp=32, ep=32, weight_dtype="fp8", software=software_for("deepseek"))
    e, cluster = engine_for(DSV3, H800, plan)
    pre = step_time(e, cluster, Work(prefill_tokens=16384, prefill_keys=2048, prefill_len=4096))
    dec = step_time(e, cluster, Work(decode_seqs=64, decode_ctx=4096))
    assert pre.overlap_sm_share == pytest.approx(24 / 132)
    assert dec.overlap_sm_share is None
    assert isinstance(pre, StepTime) and pre.to_json()["overlap_sm_share"] == pre.overlap_sm_share


def test_deepep_normal_kernels_send_a_token_once_per_remote_node() -> None:
    # DeepSeek-V3: 8 groups, a token's experts in its best 4; on 4 nodes of 2 groups each a node
    # is missed with probability C(6, 4) / C(8, 4)
    want = 3 * (1 - math.comb(6, 4) / math.comb(8, 4))
    assert remote_nodes_per_token(DSV3, 4) == pytest.approx(want)
    assert remote_nodes_per_token(DSV3, 1) == 0.0
    cluster = serving_cluster(H800, 32)
    d32, c32 = moe_normal_s(cluster, 4096, DSV3, 32, DEFAULT_PARAMS)
    bytes_out = 4096 * want * DSV3.hidden_size
    assert d32 == pytest.approx(bytes_out * (1 + 4 / 128) / 44e9)  # the README's 44 GB/s
    assert c32 == pytest.approx(bytes_out * 2 / 47e9)
    one_node = moe_normal_s(serving_cluster(H800, 8), 4096, DSV3, 8, DEFAULT_PARAMS)
    assert one_node[0] < d32  # NVLink inside a node


def test_the_busiest_expert_gpu_sets_the_moe_step() -> None:
    base = ServingPlan(dp=32, ep=32, weight_dtype="fp8")
    e1, _ = engine_for(DSV3, H100, base)
    e2, _ = engine_for(DSV3, H100, dataclasses.replace(base, moe_imbalance=1.5))
    assert routed_experts_s(e2, 16384) > routed_experts_s(e1, 16384)
    with pytest.raises(SpecError) as err:
        engine_for(DSV3, H100, dataclasses.replace(base, moe_imbalance=0.5))
    assert err.value.field == "inference.moe_imbalance"
    load = Load(4096, 1, max_batched_tokens=16384)
    balanced = prefill_throughput(DSV3, H100, base, load)[0]
    skewed = prefill_throughput(DSV3, H100, dataclasses.replace(base, moe_imbalance=1.5), load)[0]
    assert skewed < balanced


def test_estimate_inference_keeps_its_signature_and_takes_the_engine() -> None:
    kw = {"batch": 64, "prompt_len": 2048, "output_len": 2048, "tp": 4}
    kw |= {"kv_dtype": "fp8", "weight_dtype": "fp8"}
    new = estimate_inference(LLAMA2_70B, H100, **kw)
    old = estimate_inference(LLAMA2_70B, H100, **kw, software=software_for("trtllm-0.5"))
    assert old.decode_step_s > new.decode_step_s  # per-query-head KV reads
    assert old.prefill_s == pytest.approx(new.prefill_s)
    assert new.plan.to_json()["engine"]["name"] == "default"


def test_the_inference_spec_names_its_engine() -> None:
    spec = inference_from_table({"engine": "trtllm-0.5", "moe_imbalance": 1.2})
    assert spec.engine == "trtllm-0.5" and spec.moe_imbalance == 1.2
    with pytest.raises(SpecError) as err:
        inference_from_table({"moe_imbalance": 0.9})
    assert err.value.field == "inference.moe_imbalance"


def test_the_2023_rows_run_with_their_published_build_flags() -> None:
    rows = [r for r in load_rows() if r["id"].startswith("trtllm05-")]
    assert rows and all(r["engine"] == "trtllm-0.5" and r["kv_dtype"] == "fp8" for r in rows)
    row = next(r for r in rows if r["model"] == "llama2-70b")  # GQA: the per-head reads matter
    assert predict_row({**row, "engine": "default"}) > predict_row(row)
