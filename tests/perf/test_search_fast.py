"""The array search gives the per-plan search's answers: the same counts, the same ranking and
the same refusals, and every plan priced as the scalar estimate_plan priced it (1e-12 relative).

The references are the search as it was before plans were priced as arrays (_scalar_search.py:
one ParallelPlan and one estimate_plan per plan) and estimate_plan as it was before its terms
were shared with the array search (_scalar_estimate.py), run here at test time."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from _scalar_estimate import estimate_plan as scalar_estimate_plan
from _scalar_search import search as scalar_search

from aihpc.perf.search.ranking import _valid_batch, candidate_plans, search
from aihpc.perf.step.batch import price_batch
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec import load_runspec, runspec_from_dict
from aihpc.runspec.parallel import PartialPlan

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def preset(model: str, gpu: str, n: int, parallel: dict, training: dict | None = None):
    return runspec_from_dict(
        {
            "model": {"preset": model},
            "cluster": {"gpu": gpu, "num_gpus": n, "gpus_per_node": 8},
            "parallel": parallel,
            "training": training or {},
        }
    )


def calibrated():
    """The calibrated example with only the batch fixed: calibrated collectives everywhere."""
    spec = load_runspec(EXAMPLES / "llama3-70b-calibrated.toml")
    return replace(spec, parallel=PartialPlan(global_batch_size=64))


def run_fitted():
    """Efficiency scales fitted to measured runs (aihpc calibrate --runs), no measured fits."""
    from aihpc.runspec.calibration import Calibration, EfficiencyScales

    spec = preset("llama3-70b", "h100-sxm", 128, {"global_batch_size": 128})
    scales = EfficiencyScales(gemm=0.9, attention=1.1, scale_up=0.8, scale_out=0.7)
    cluster = replace(spec.cluster, calibration=Calibration(efficiency=scales))
    return replace(spec, cluster=cluster)


SPECS = {
    # the README's search examples
    "readme-llama3-70b": lambda: load_runspec(EXAMPLES / "llama3-70b-search.toml"),
    "readme-tiny-4gpu": lambda: load_runspec(EXAMPLES / "tiny-4gpu.toml"),
    # presets: dense with auto-offload, MoE, calibration
    "llama3-8b-offload": lambda: preset("llama3-8b", "h100-sxm", 64, {"global_batch_size": 64}),
    "mixtral-8x7b": lambda: preset(
        "mixtral-8x7b", "h100-sxm", 64, {"global_batch_size": 128, "zero_stage": 1}
    ),
    "deepseek-v3": lambda: preset(
        "deepseek-v3", "h800", 512, {"tp": 1, "pp": 16, "global_batch_size": 1024}
    ),
    # the routed experts launched one GEMM per local expert (Transformer Engine's cuBLAS path)
    "qwen3-per-expert-fp8": lambda: preset(
        "qwen3-30b-a3b",
        "h100-sxm",
        16,
        {"pp": 1, "global_batch_size": 256},
        {"precision": "fp8", "moe_expert_gemm": "per_expert"},
    ),
    "calibrated": calibrated,
    "run-fitted-scales": run_fitted,
    # the training options that change the arithmetic
    "balanced-zbv": lambda: preset(
        "llama3-70b",
        "h100-sxm",
        256,
        {"pp_schedule": "zbv", "global_batch_size": 256},
        {"pipeline_split": "balanced"},
    ),
    "even-no-overlap": lambda: preset(
        "llama3-70b",
        "h100-sxm",
        128,
        {"global_batch_size": 128, "dp_shard": 2},
        {"pipeline_split": "even", "grad_reduce_overlap": False},
    ),
    "userbuffers-fp8": lambda: preset(
        "llama3-70b",
        "h100-sxm",
        128,
        {"global_batch_size": 128},
        {"tp_comm_overlap": "userbuffers", "precision": "fp8"},
    ),
    "async-tp": lambda: preset(
        "llama3-8b", "h100-sxm", 64, {"global_batch_size": 64}, {"tp_comm_overlap": "async_tp"}
    ),
    "no-tp-overlap": lambda: preset(
        "gpt3-175b", "h100-sxm", 128, {"global_batch_size": 128}, {"tp_comm_overlap": "none"}
    ),
    "per-tensor-zero3": lambda: preset(
        "llama3-8b", "h100-sxm", 64, {"global_batch_size": 128}, {"zero3_gather": "per_tensor"}
    ),
    "allgather-cp-fp8": lambda: preset(
        "llama3-8b",
        "h100-sxm",
        64,
        {"global_batch_size": 64, "recompute_modules": ["layernorm"]},
        {"cp_exchange": "allgather", "precision": "fp8"},
    ),
    "gpt3-eager-bf16-states": lambda: preset(
        "gpt3-175b",
        "h100-sxm",
        128,
        {"tp": 8, "global_batch_size": 128},
        {
            "attention": "unfused",
            "dropout": 0.1,
            "fused_kernels": False,
            "cross_entropy": "eager",
            "grad_reduce_dtype": "bf16",
            "optimizer_dtype": "bf16",
            "kv_repeat": True,
        },
    ),
    "dualpipe-mla-modules": lambda: preset(
        "deepseek-v3",
        "h800",
        512,
        {
            "tp": 1,
            "pp": 16,
            "moe_a2a_overlap": "dualpipe",
            "recompute_modules": ["mla_up_proj", "moe_act"],
            "global_batch_size": 1024,
        },
        {"moe_dispatcher": "hierarchical", "moe_dispatch_dtype": "fp8", "precision": "fp8"},
    ),
    # a pre-FlashAttention-2 kernel on long sequences: its efficiency follows each plan's CP
    "triton-long-cp": lambda: runspec_from_dict(
        {
            "model": {"preset": "llama3-8b", "seq_length": 65536},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 32, "gpus_per_node": 8},
            "parallel": {"global_batch_size": 32},
            "training": {"attention": "triton"},
        }
    ),
    "fixed-offload": lambda: preset(
        "llama3-8b", "h100-sxm", 64, {"pp": 1, "offload_layers": 4, "global_batch_size": 64}
    ),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_array_search_matches_the_per_plan_search(name: str) -> None:
    spec = SPECS[name]()
    old = scalar_search(spec, explain=5)
    new = search(spec, top=len(old.plans) or None, explain=5)
    assert (new.evaluated, new.feasible) == (old.evaluated, old.feasible)
    assert [e.plan for e in new.plans] == [e.plan for e in old.plans]  # the whole ranking
    for a, b in zip(new.plans[:20], old.plans[:20], strict=True):
        assert a.step_time_s == pytest.approx(b.step_time_s, rel=1e-12)
        assert a.to_json() == b.to_json()
    assert [r.estimate.plan for r in new.rejected_best] == [
        r.estimate.plan for r in old.rejected_best
    ]
    assert list(new.invalid_reasons.items()) == list(old.invalid_reasons.items())
    assert {k: str(v) for k, v in new.invalid_examples.items()} == {
        k: str(v) for k, v in old.invalid_examples.items()
    }


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_plan_priced_as_estimate_plan_prices_it(name: str) -> None:
    """Not only the ranked plans: every candidate's step time, memory and fit, against the
    frozen scalar estimate (estimate_plan itself now runs these terms on one plan)."""
    spec = SPECS[name]()
    batch, _ = _valid_batch(spec.model, spec.cluster, spec.parallel, spec.training, None, None)
    if name == "balanced-zbv":  # the search drops a given schedule; price it here
        batch = replace(batch, pp_schedule="zbv")
        batch = batch.take(np.nonzero((batch.pp > 1) & (batch.vpp == 2))[0])
    if name == "even-no-overlap":  # and a given dp_shard (HSDP)
        batch = replace(batch, dp_shard=2)
        batch = batch.take(np.nonzero((batch.zero > 0) & (batch.dp % 2 == 0))[0])
    if spec.cluster.gpu.host_link_GBps is not None and spec.parallel.offload_layers is None:
        batch = batch.with_offload(np.where(batch.pp == 1, batch.offload + 1, batch.offload))
        batch = batch.take(np.nonzero((batch.rec != 3) | (batch.offload == 0))[0])
    times = price_batch(spec.model, spec.cluster, batch, spec.training, DEFAULT_PARAMS)
    rng = np.random.default_rng(0)
    sample = rng.choice(len(batch), size=min(len(batch), 400), replace=False)
    for i in sample:
        plan = batch.plan(i)
        est = scalar_estimate_plan(spec.model, spec.cluster, plan, spec.training, check=False)
        assert times.step_time_s[i] == pytest.approx(est.step_time_s, rel=1e-12, abs=0)
        assert times.memory_total[i] == pytest.approx(est.memory.total, rel=1e-12, abs=0)
        assert times.offloaded[i] == pytest.approx(est.memory.offloaded, rel=1e-12, abs=0)
        assert bool(times.fits[i]) == est.fits


def test_candidate_plans_are_the_searched_ones_in_order() -> None:
    from _scalar_search import candidate_plans as scalar_candidates

    spec = SPECS["mixtral-8x7b"]()
    args = (spec.model, spec.cluster, spec.parallel)
    assert list(candidate_plans(*args)) == list(scalar_candidates(*args))


def test_group_numbers_distinct_rows_even_when_the_key_would_overflow() -> None:
    from aihpc.perf.step.plan_batch import group

    rng = np.random.default_rng(0)
    cols = [rng.integers(0, 3, 200) * (1 << 40) + rng.integers(0, 2, 200) for _ in range(4)]
    one, inv = group(*cols)
    rows = list(zip(*(c.tolist() for c in cols), strict=True))
    assert len(one) == len(set(rows))
    for i, row in enumerate(rows):  # same group number exactly when the rows are equal
        assert rows[one[inv[i]]] == row
    assert len({rows[i] for i in one}) == len(one)
