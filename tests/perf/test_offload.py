"""Activation offloading (parallel.offload_layers): memory, copy time, the rules, the search."""

from dataclasses import replace

import pytest

from aihpc.perf.fit.validate import data_file, row_runspec
from aihpc.perf.search.ranking import search
from aihpc.perf.step.batch_memory import memory_breakdown
from aihpc.perf.step.estimate import estimate_plan
from aihpc.perf.step.memory import GiB, activation_bytes_per_layer
from aihpc.runspec import SpecError, runspec_from_dict

# Llama 3 70B under FSDP on 64 GB200s, micro-batch 2: without recompute its activations do not
# fit in 186 GiB, the case NVIDIA's Megatron-Bridge recipe offloads 40 of 80 layers for.
BASE = {
    "model": {"preset": "llama3-70b"},
    "cluster": {"gpu": "gb200", "num_gpus": 64},
    "parallel": {
        "tp": 1,
        "pp": 1,
        "cp": 1,
        "zero_stage": 3,
        "micro_batch_size": 2,
        "global_batch_size": 256,
    },
    "training": {"precision": "fp8"},
}


def spec(parallel=None, gpu_spec=None, **cluster):
    d = {**BASE, "parallel": {**BASE["parallel"], **(parallel or {})}}
    d["cluster"] = {**BASE["cluster"], **cluster}
    if gpu_spec:
        d["cluster"]["gpu_spec"] = gpu_spec
    return runspec_from_dict(d)


def est(s):
    return estimate_plan(s.model, s.cluster, s.plan(), s.training)


def test_offloaded_layers_leave_gpu_memory_for_host_memory() -> None:
    s0 = spec({"recompute": "none"})
    act = activation_bytes_per_layer(s0.model, s0.plan(), s0.training)
    m0 = memory_breakdown(s0.model, s0.cluster, s0.plan(), s0.training)
    for k in (1, 10, 40, 78):
        s = spec({"recompute": "none", "offload_layers": k})
        m = memory_breakdown(s.model, s.cluster, s.plan(), s.training)
        assert m0.activations - m.activations == pytest.approx(k * act)
        assert m.offloaded == pytest.approx(k * act)
        assert m.total < m0.total
    # The double buffer keeps two layers on the GPU even when all but one are offloaded.
    last = spec({"recompute": "none", "offload_layers": 79})
    m = memory_breakdown(last.model, last.cluster, last.plan(), last.training)
    assert m.activations == pytest.approx(2 * act)
    assert m0.offloaded == 0


def test_copies_cost_only_what_the_layers_cannot_hide() -> None:
    # A link fast enough to hide every copy behind its layer: no time, same step as no offload.
    fast = est(spec({"recompute": "none", "offload_layers": 40}, {"host_link_GBps": 1e6}))
    none = est(spec({"recompute": "none"}))
    assert fast.time_s["offload"] == 0
    assert fast.step_time_s == pytest.approx(none.step_time_s)
    # Two links both too slow to hide: the exposed time differs by the copies' extra seconds,
    # out in the forward and back in the backward, for each offloaded layer and micro-batch.
    s = spec({"recompute": "none", "offload_layers": 40}, {"host_link_GBps": 20.0})
    slow = est(s)
    slower = est(spec({"recompute": "none", "offload_layers": 40}, {"host_link_GBps": 10.0}))
    act = activation_bytes_per_layer(s.model, s.plan(), s.training)
    m = s.plan().num_microbatches
    extra = m * 40 * 2 * act * (1 / 10e9 - 1 / 20e9)
    assert slower.time_s["offload"] - slow.time_s["offload"] == pytest.approx(extra)
    assert sum(slow.time_s.values()) == pytest.approx(slow.step_time_s)


def test_host_memory_bounds_what_can_be_offloaded() -> None:
    s = spec({"recompute": "none", "offload_layers": 40}, {"host_mem_gib": 100.0})
    e = est(s)
    assert e.memory.offloaded / GiB > 100 and not e.fits
    assert "host memory" in e.bottleneck
    assert e.to_json()["host_offload_gib"] == pytest.approx(e.memory.offloaded / GiB)


@pytest.mark.parametrize(
    ("parallel", "cluster", "allowed"),
    [
        ({"offload_layers": 80}, {}, "less than num_layers 80"),
        ({"offload_layers": 4, "pp": 2}, {}, "pipeline"),
        ({"offload_layers": 4, "recompute": "full"}, {}, "full"),
        ({"offload_layers": 4}, {"gpu": "mi300x", "gpus_per_node": 8}, "host_link_GBps"),
        ({"offload_layers": -1}, {}, "≥ 0"),
    ],
)
def test_offloading_rules_name_the_field(parallel, cluster, allowed) -> None:
    with pytest.raises(SpecError) as err:
        est(spec({"recompute": "none", **parallel}, **cluster))
    assert err.value.field == "parallel.offload_layers"
    assert allowed in str(err.value)


def test_search_offloads_the_fewest_layers_that_fit() -> None:
    s = spec({"recompute": "none"})
    result = search(s)
    plans = {e.plan.recompute: e for e in result.plans}
    best_none = plans["none"]
    k = best_none.plan.offload_layers
    assert k > 0 and best_none.fits
    fewer = replace(best_none.plan, offload_layers=k - 1)
    assert not estimate_plan(s.model, s.cluster, fewer, s.training).fits
    # The ranked estimate is the plan's own estimate, not a search-only figure.
    fresh = estimate_plan(s.model, s.cluster, best_none.plan, s.training)
    assert fresh.step_time_s == best_none.step_time_s


def test_search_keeps_a_given_offload_count_and_zero_means_none() -> None:
    off = search(spec({"recompute": "none", "offload_layers": 0}))
    assert off.plans == [] and off.evaluated == 1
    fixed = search(spec({"offload_layers": 44}))
    assert fixed.plans and all(e.plan.offload_layers == 44 for e in fixed.plans)
    assert all(e.plan.recompute != "full" for e in fixed.plans)


def test_validation_rows_offload_only_where_the_source_says_so() -> None:
    import csv

    with open(data_file("heldout_runs.csv"), newline="") as f:
        rows = {r["id"]: r for r in csv.DictReader(f)}
    n2 = row_runspec(rows["N2"])
    assert n2.parallel.offload_layers == 40 and n2.parallel.recompute == "none"
    assert row_runspec(rows["N1"]).parallel.offload_layers == 0  # empty cell: none, not searched
