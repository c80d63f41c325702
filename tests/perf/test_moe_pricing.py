"""Mixture of experts in the planner (issue 17): presets against published parameter counts,
Megatron-Core's parallel-folding rules, MoE memory (experts over etp x ep, their optimizer over
expert data parallel, attention never divided by ep), the expert-parallel all-to-all on the real
topology, its overlap, and the MoE validation set."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from aihpc.perf.fit.validate import validate
from aihpc.perf.search.ranking import search_plans
from aihpc.perf.step import comm
from aihpc.perf.step.batch_memory import memory_breakdown
from aihpc.perf.step.estimate import estimate_plan
from aihpc.perf.step.flops import (
    active_params,
    attention_params,
    embedding_params,
    expert_params_per_layer,
    mlp_params,
    model_flops_per_token,
    num_params,
)
from aihpc.perf.step.memory import GiB, layer_params_split
from aihpc.runspec.errors import SpecError
from aihpc.runspec.model import model_from_table
from aihpc.runspec.parallel import ParallelPlan, plan_problem
from aihpc.runspec.runspec import RunSpec, runspec_from_dict


def spec(model: str, gpu: str, gpus: int, parallel: dict[str, Any], **training: Any) -> RunSpec:
    return runspec_from_dict(
        {
            "model": {"preset": model},
            "cluster": {"gpu": gpu, "num_gpus": gpus},
            "parallel": {"global_batch_size": 1024, **parallel},
            "training": training,
        }
    )


# Published totals and active parameters, in billions, with where they are printed.
PUBLISHED = [
    ("deepseek-v3", 671, 37),  # DeepSeek-V3 report, abstract (MTP module excluded)
    ("mixtral-8x7b", 46.7, 12.9),  # Mixtral paper, sec. 2
    ("mixtral-8x22b", 141, 39),  # Mistral AI announcement
    ("qwen3-30b-a3b", 30.5, 3.3),  # Qwen3 report, Table 2
    ("qwen3-235b-a22b", 235, 22),  # Qwen3 report, Table 2
    ("llama4-maverick", 400, 17),  # Meta's Llama 4 announcement
    ("kimi-k2", 1040, 32),  # Kimi K2 report, abstract
    ("grok-1", 314, None),  # xAI release (active not stated)
]


@pytest.mark.parametrize(("name", "total", "active"), PUBLISHED)
def test_preset_parameters_match_the_published_counts(
    name: str, total: float, active: float | None
) -> None:
    m = model_from_table({"preset": name})
    # Kimi's 1.04T is rounded up from a count our shapes put at 1.026T (1.3%); the others agree
    # within the precision they are printed to.
    assert num_params(m) / 1e9 == pytest.approx(total, rel=0.02)
    if active is not None:
        assert active_params(m) / 1e9 == pytest.approx(active, rel=0.03)


def test_gpt_oss_counts_follow_its_model_card() -> None:
    """OpenAI's table: 116.83B total; 5.13B active, which counts the unembedding but not the
    input embedding."""
    m = model_from_table({"preset": "gpt-oss-120b"})
    assert num_params(m) / 1e9 == pytest.approx(116.83, rel=0.005)
    assert (active_params(m) - embedding_params(m)) / 1e9 == pytest.approx(5.13, rel=0.01)


def test_mla_attention_parameters_are_deepseek_v3s() -> None:
    """Each projection of DeepSeek-V3's released checkpoint (config.json shapes): q_a 7168x1536,
    q_b 1536x(128x192), kv_a 7168x576, kv_b 512x(128x256), o (128x128)x7168, two latent norms."""
    m = model_from_table({"preset": "deepseek-v3"})
    expected = (
        (7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168)
        + 1536
        + 512
    )
    assert attention_params(m) == expected


def test_moe_flops_count_the_active_experts_only() -> None:
    """6 x active parameters is the GEMM part of the training FLOPs (no attention core, no
    logits): the model FLOPs exceed it by those, and a model with every expert active would be
    far above it."""
    m = model_from_table({"preset": "qwen3-30b-a3b"})
    fl = model_flops_per_token(m)
    assert 6 * active_params(m) < fl < 6 * active_params(m) * 1.6
    dense_all = replace(m, moe_top_k=m.num_experts)
    idle = (m.num_experts - m.moe_top_k) * mlp_params(m, 768) * 48  # weights a token skips
    assert model_flops_per_token(dense_all) - fl == pytest.approx(6 * idle)


def plan_of(**kw: Any) -> ParallelPlan:
    return ParallelPlan(**{"global_batch_size": 1024, **kw})


def test_expert_parallel_may_span_the_tensor_parallel_ranks() -> None:
    """Parallel folding: Mixtral on 8 GPUs with TP 8 and EP 8 (dp 1) is legal in Megatron-Core,
    where the old rule (ep divides dp x cp) refused it."""
    s = spec("mixtral-8x7b", "h100-sxm", 8, {"tp": 8, "ep": 8})
    assert plan_problem(s.plan(), s.model, s.cluster) is None
    bad = replace(s.plan(), ep=8, etp=2)  # 16 expert ranks over 8 GPUs
    err = plan_problem(bad, s.model, s.cluster)
    assert err is not None and "EP folding rule" in err.allowed


def test_ep_rules_name_themselves() -> None:
    s = spec("mixtral-8x7b", "h100-sxm", 16, {"tp": 1})
    err = plan_problem(replace(s.plan(), ep=16), s.model, s.cluster)
    assert err is not None and err.field == "parallel.ep" and "num_experts 8" in err.allowed
    dense = spec("llama3-8b", "h100-sxm", 8, {"tp": 1})
    err = plan_problem(replace(dense.plan(), ep=2), dense.model, dense.cluster)
    assert err is not None and "mixture-of-experts" in err.allowed


def test_search_refusal_names_the_ep_rule_not_memory() -> None:
    """A fixed ep no combination can honour: the search evaluates nothing and its refusal is
    the EP rule, which the CLI raises instead of 'no plan fits'."""
    s = runspec_from_dict(
        {
            "model": {"preset": "mixtral-8x7b"},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 16},
            "parallel": {"global_batch_size": 1024, "ep": 16},
        }
    )
    result = search_plans(s.model, s.cluster, s.parallel, s.training, top=1)
    assert result.evaluated == 0
    refusal = result.refusal()
    assert isinstance(refusal, SpecError) and refusal.field == "parallel.ep"
    assert "EP rule" in refusal.allowed


def test_search_explores_expert_parallel() -> None:
    s = runspec_from_dict(
        {
            "model": {"preset": "qwen3-30b-a3b"},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 16},
            "parallel": {
                "global_batch_size": 256,
                "pp": 1,
                "cp": 1,
                "micro_batch_size": 1,
                "zero_stage": 1,
                "recompute": "full",
            },
            "training": {"precision": "fp8"},
        }
    )
    result = search_plans(s.model, s.cluster, s.parallel, s.training)
    eps = {e.plan.ep for e in result.plans}
    assert {1, 8, 16} <= eps
    assert {(e.plan.ep > 1, e.plan.moe_a2a_overlap) for e in result.plans} == {
        (False, "none"),
        (True, "1f1b"),
    }


def test_attention_weights_are_not_divided_by_ep() -> None:
    """Doubling ep halves the routed experts on a GPU and leaves everything else."""
    m = model_from_table({"preset": "deepseek-v3"})
    a = layer_params_split(m, plan_of(ep=8, dp=8), 61)
    b = layer_params_split(m, plan_of(ep=16, dp=16), 61)
    assert a[0] == b[0]
    assert a[1] == pytest.approx(2 * b[1])
    assert a[1] == pytest.approx(58 * expert_params_per_layer(m) / 8)
    # the split part holds attention, norms, the three dense FFNs, shared experts and routers
    routed_all = 58 * expert_params_per_layer(m)
    layers_total = num_params(m) - 2 * embedding_params(m) - m.hidden_size
    assert a[0] == pytest.approx(layers_total - routed_all)
    # expert tensor parallel splits each expert further
    c = layer_params_split(m, plan_of(ep=8, etp=2, tp=2, dp=8), 61)
    assert c[1] == pytest.approx(a[1] / 2)


def test_expert_optimizer_is_sharded_over_expert_data_parallel() -> None:
    """ZeRO-1 on 64 GPUs of one stage: attention's fp32 master + moments over dp = 64, routed
    experts' over edp = 64 / ep."""
    s = spec(
        "mixtral-8x7b",
        "h100-sxm",
        64,
        {"tp": 1, "pp": 1, "zero_stage": 1, "ep": 8, "micro_batch_size": 1},
    )
    plan = s.plan()
    assert plan.expert_dp == 8
    mem = memory_breakdown(s.model, s.cluster, plan, s.training)
    dense, experts = layer_params_split(s.model, plan, s.model.num_layers)
    dense += 2 * embedding_params(s.model)
    assert mem.optimizer == pytest.approx(12 * dense / 64 + 12 * experts / 8)
    assert mem.weights == pytest.approx(2 * (dense + experts))


def test_dualpipe_keeps_two_copies_of_the_weights() -> None:
    s = spec("deepseek-v3", "h800", 2048, {"tp": 1, "pp": 16, "ep": 64, "micro_batch_size": 1})
    plain = memory_breakdown(s.model, s.cluster, s.plan(), s.training)
    dual = replace(s.plan(), moe_a2a_overlap="dualpipe")
    assert plan_problem(dual, s.model, s.cluster) is None
    two = memory_breakdown(s.model, s.cluster, dual, s.training)
    assert two.weights == pytest.approx(2 * plain.weights)
    err = plan_problem(replace(dual, pp=15, dp=2048 // 15), s.model, s.cluster)
    assert err is not None


def test_remote_domains_per_token() -> None:
    # one domain: nothing remote; uniform top-8 over 8 nodes: 8 (1 - (7/8)^8) touched
    assert comm.remote_domains_per_token(1, 8) == 0.0
    touched = 8 * (1 - (7 / 8) ** 8)
    assert comm.remote_domains_per_token(8, 8) == pytest.approx(touched * 7 / 8)
    # DeepSeek-V3's node-limited routing: at most 4 of the 8 nodes
    assert comm.remote_domains_per_token(8, 8, 8, 4) == pytest.approx(4 * 7 / 8)


def test_all_to_all_inside_a_node_runs_on_nvlink() -> None:
    c = spec("mixtral-8x7b", "h100-sxm", 16, {"tp": 1}).cluster
    size = 64e6
    one_node = comm.moe_all_to_all_time_s(c, size, size / 2, 8, 1, False, 0.0)
    up = c.scale_up_bw_GBps * 0.80 * 1e9
    assert one_node == pytest.approx(5e-6 + size * 7 / 8 / up)
    # across two nodes the flat all-to-all sends half of every rank's copies over its NIC
    two = comm.moe_all_to_all_time_s(c, size, size / 2, 16, 1, False, 1.0)
    out = c.scale_out_bw_GBps * 0.85 * 1e9
    assert two == pytest.approx(15e-6 + max(size * 7 / 16 / up, size * 8 / 16 / out))
    # hierarchical: each token crosses once per remote node, not once per copy
    hier = comm.moe_all_to_all_time_s(c, size, size / 8, 16, 1, True, 1.0)
    assert hier < two


def test_ep_comm_is_priced_and_the_overlap_hides_some() -> None:
    base = spec(
        "qwen3-235b-a22b",
        "h100-sxm",
        256,
        {
            "tp": 2,
            "pp": 8,
            "vpp": 4,
            "ep": 32,
            "zero_stage": 1,
            "recompute": "none",
            "micro_batch_size": 1,
            "global_batch_size": 2048,
        },
        precision="fp8",
    )
    plan = base.plan()
    none = estimate_plan(base.model, base.cluster, plan, base.training)
    hid = estimate_plan(
        base.model, base.cluster, replace(plan, moe_a2a_overlap="1f1b"), base.training
    )
    assert none.time_s["ep_comm"] > 0.1 * none.step_time_s
    assert hid.time_s["ep_comm"] < none.time_s["ep_comm"]
    assert hid.step_time_s < none.step_time_s
    # the hierarchical dispatcher sends less across nodes than the flat all-to-all
    hier = estimate_plan(
        base.model, base.cluster, plan, replace(base.training, moe_dispatcher="hierarchical")
    )
    assert hier.time_s["ep_comm"] < none.time_s["ep_comm"]
    # routing imbalance: the busiest rank's experts and all-to-all take more tokens
    skew = estimate_plan(base.model, base.cluster, plan, replace(base.training, moe_imbalance=1.5))
    assert skew.step_time_s > none.step_time_s
    assert skew.time_s["ep_comm"] == pytest.approx(1.5 * none.time_s["ep_comm"], rel=0.01)


def test_expert_tensor_parallel_gathers_over_etp() -> None:
    s = spec(
        "mixtral-8x7b",
        "h100-sxm",
        16,
        {"tp": 2, "ep": 4, "zero_stage": 1, "recompute": "none", "micro_batch_size": 1},
    )
    a = estimate_plan(s.model, s.cluster, s.plan(), s.training)
    b = estimate_plan(s.model, s.cluster, replace(s.plan(), etp=2), s.training)
    assert b.time_s["ep_comm"] > a.time_s["ep_comm"]
    assert b.memory.weights < a.memory.weights


@pytest.fixture(scope="module")
def moe_report():
    return validate(moe=True)


def test_moe_validation_rows_are_all_expressible(moe_report) -> None:
    """Every row of the MoE development set is priced (no refusal), with its published plan."""
    report = moe_report
    assert len(report.rows) == 13
    for r in report.rows:
        assert r.predicted > 0
        assert r.estimate.plan.ep > 1
    k01 = next(r for r in report.rows if r.id == "K01")
    assert k01.plan.moe_a2a_overlap == "dualpipe"
    assert set(report.targets_met) == {"mape", "max_abs_error"}
    assert report.to_json()["moe"] is True


def test_moe_memory_counts_routed_token_activations() -> None:
    s = spec(
        "qwen3-30b-a3b",
        "h100-sxm",
        16,
        {"tp": 1, "ep": 16, "zero_stage": 1, "recompute": "none", "micro_batch_size": 1},
    )
    one = memory_breakdown(s.model, s.cluster, s.plan(), s.training)
    top = replace(s.model, moe_top_k=16)
    two = memory_breakdown(top, s.cluster, s.plan(), s.training)
    assert two.activations > 1.5 * one.activations
    assert one.total / GiB < 80


def test_mlp_params_helper_is_used_for_experts() -> None:
    m = model_from_table({"preset": "mixtral-8x7b"})
    assert expert_params_per_layer(m) == 8 * mlp_params(m, 14336)


def test_balanced_split_gives_the_loss_a_layer_slot() -> None:
    """DeepSeek-V3 on 8 x 4 chunks: 61 layers + MTP + embedding + loss = 64 slots, 8 per stage;
    the last stage runs 7 layers beside its two output heads, so it is faster than 8 layers
    plus the heads (the uneven split) and never slower than 8 plain layers."""
    s = spec(
        "deepseek-v3",
        "h100-sxm",
        1024,
        {
            "tp": 2,
            "pp": 8,
            "vpp": 4,
            "ep": 64,
            "zero_stage": 1,
            "recompute": "none",
            "micro_batch_size": 1,
            "global_batch_size": 8192,
        },
        precision="fp8",
    )
    uneven = estimate_plan(s.model, s.cluster, s.plan(), s.training)
    bal = estimate_plan(
        s.model, s.cluster, s.plan(), replace(s.training, pipeline_split="balanced")
    )
    assert bal.time_s["compute"] < uneven.time_s["compute"]


def test_docs_quote_the_moe_validation_table_of_this_commit(moe_report) -> None:
    """docs/performance-model.md must show exactly what `aihpc validate --moe` prints today."""
    from pathlib import Path

    from aihpc.cli.validate import validation_table

    docs = Path(__file__).resolve().parents[2] / "docs" / "performance-model.md"
    assert validation_table(moe_report) in docs.read_text(encoding="utf-8")


@pytest.mark.xfail(
    strict=True,
    reason="issue 17's MoE targets (MAPE <= 15%, no row beyond 30%) are not met yet: "
    "see docs/performance-model.md, MoE validation",
)
def test_moe_targets(moe_report) -> None:
    assert moe_report.passed


def test_recompute_modules_trade_memory_for_time() -> None:
    """Each module drops what it saved and runs its forward again in the backward."""
    s = spec(
        "deepseek-v3",
        "gb200",
        256,
        {
            "tp": 1,
            "pp": 4,
            "vpp": 4,
            "ep": 64,
            "zero_stage": 1,
            "recompute": "none",
            "micro_batch_size": 1,
            "global_batch_size": 4096,
        },
        precision="fp8",
    )
    base = estimate_plan(s.model, s.cluster, s.plan(), s.training)
    for mods in (["mla_up_proj"], ["moe_act"], ["layernorm"], ["mla_up_proj", "moe_act"]):
        plan = replace(s.plan(), recompute_modules=tuple(mods))
        est = estimate_plan(s.model, s.cluster, plan, s.training)
        assert est.memory.activations < base.memory.activations, mods
        assert est.time_s["recompute"] > 0 and est.step_time_s > base.step_time_s, mods
    full = replace(s.plan(), recompute="full", recompute_modules=("moe_act",))
    err = plan_problem(full, s.model, s.cluster)
    assert err is not None and err.field == "parallel.recompute_modules"
    dense = spec("llama3-8b", "h100-sxm", 8, {"tp": 1})
    err = plan_problem(
        replace(dense.plan(), recompute_modules=("mla_up_proj",)), dense.model, dense.cluster
    )
    assert err is not None and "MLA" in err.allowed
    with pytest.raises(SpecError):
        spec("llama3-8b", "h100-sxm", 8, {"recompute_modules": ["attention"]})


def test_an_all_to_all_calibration_prices_the_dispatch() -> None:
    """A measured all_to_all fit (aihpc bench moe -> aihpc calibrate) replaces the NVLink
    tier's bandwidth and latency."""
    from aihpc.runspec.calibration import Calibration, CommFit, CommRegime

    c = spec("mixtral-8x7b", "h100-sxm", 8, {"tp": 1}).cluster
    fit = CommFit("all_to_all", "scale_up", (CommRegime(12.0, 100.0),), num_ranks=8)
    measured = replace(c, calibration=Calibration(comm={("all_to_all", "scale_up"): fit}))
    size = 64e6
    got = comm.moe_all_to_all_time_s(measured, size, size / 2, 8, 1, False, 0.0)
    assert got == pytest.approx(12e-6 + size * 7 / 8 / 100e9)
