"""estimate_plan, now a sum of named terms shared with the array search, gives the answers of the
scalar function it replaced (aihpc 21, item 1): ``to_json()`` equal, floats to 1e-12 relative,
on the README examples, the presets and every training option the search's equality test
covers, and on a grid of the plan fields that switch a term on or off (ZeRO 0-3, recompute
kinds, pipeline schedules, MoE overlap, CP, EP, offload); and compute.layer_times, split into
kernel-class terms, gives the LayerTimes it gave. The references are the functions as they were
(_scalar_estimate.py), run here at test time."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _scalar_estimate import estimate_plan as scalar_estimate_plan
from _scalar_estimate import layer_times as scalar_layer_times
from test_search_fast import SPECS

from aihpc.perf.search.ranking import _valid_batch
from aihpc.perf.step import compute
from aihpc.perf.step.estimate import estimate_plan
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec import load_runspec, runspec_from_dict
from aihpc.runspec.errors import SpecError
from aihpc.runspec.parallel import MOE_A2A_OVERLAPS, RECOMPUTE, ParallelPlan, validate_plan

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def assert_same(new: Any, old: Any, where: str = "") -> None:
    """Equal JSON trees; floats to 1e-12 relative (0.0 exactly)."""
    if isinstance(old, float) and not isinstance(old, bool):
        assert isinstance(new, float), where
        assert new == pytest.approx(old, rel=1e-12, abs=0), where
    elif isinstance(old, dict):
        assert list(new) == list(old), where
        for key in old:
            assert_same(new[key], old[key], f"{where}.{key}")
    elif isinstance(old, list):
        assert len(new) == len(old), where
        for i, (a, b) in enumerate(zip(new, old, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert type(new) is type(old) and new == old, where


def check_plan(spec: Any, plan: Any, check: bool = True) -> None:
    args = (spec.model, spec.cluster, plan, spec.training)
    try:
        old = scalar_estimate_plan(*args, check=check)
    except SpecError as err:
        with pytest.raises(SpecError) as got:
            estimate_plan(*args, check=check)
        assert str(got.value) == str(err)
        return
    new = estimate_plan(*args, check=check).to_json()
    json.dumps(new)  # plain Python numbers, as the CLI prints them
    assert_same(_priced(new), _priced(old.to_json()), str(plan))


# What the estimate reports beyond the frozen reference's figures (issue 34): the parameter
# counts, the communication hidden behind compute and the peak MFU is quoted on. None of them
# changes a priced figure; tests/perf/test_estimate_reports.py checks each.
REPORTED_SINCE = ("params", "hidden_s", "mfu_peak", "mfu_bf16_peak")


def _priced(out: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in out.items() if k not in REPORTED_SINCE}


@pytest.mark.parametrize(
    "name",
    [
        "llama3-70b.toml",
        "llama3-70b-calibrated.toml",
        "llama3-405b-16k.toml",
        "deepseek-v3-h800.toml",
        "tiny-train.toml",
        "tiny-moe-train.toml",
    ],
)
def test_examples_priced_as_before(name: str) -> None:
    spec = load_runspec(EXAMPLES / name)
    check_plan(spec, spec.plan())


@pytest.mark.parametrize("name", sorted(SPECS))
def test_searched_plans_priced_as_before(name: str) -> None:
    """A sample of each preset's candidates, with the options test_search_fast.py prices."""
    spec = SPECS[name]()
    batch, _ = _valid_batch(spec.model, spec.cluster, spec.parallel, spec.training, None, None)
    if name == "balanced-zbv":
        batch = replace(batch, pp_schedule="zbv")
        batch = batch.take(np.nonzero((batch.pp > 1) & (batch.vpp == 2))[0])
    if name == "even-no-overlap":
        batch = replace(batch, dp_shard=2)
        batch = batch.take(np.nonzero((batch.zero > 0) & (batch.dp % 2 == 0))[0])
    if spec.cluster.gpu.host_link_GBps is not None and spec.parallel.offload_layers is None:
        batch = batch.with_offload(np.where(batch.pp == 1, batch.offload + 1, batch.offload))
    rng = np.random.default_rng(1)
    for i in rng.choice(len(batch), size=min(len(batch), 60), replace=False):
        check_plan(spec, batch.plan(int(i)), check=False)


GRID = {
    "zero_stage": (0, 1, 2, 3),
    "recompute": RECOMPUTE,
    "pp_vpp_schedule": ((1, 1, None), (4, 1, None), (4, 2, None), (4, 2, "zbv")),
}


@pytest.mark.parametrize(
    "base, extra",
    [
        ("llama3-70b.toml", {"cp": 2, "dp": 16}),
        ("llama3-70b.toml", {"cp": 1, "dp": 32, "offload_layers": 2}),
        ("deepseek-v3-h800.toml", {}),
    ],
)
def test_plan_grid_priced_as_before(base: str, extra: dict) -> None:
    """Every combination of ZeRO stage, recompute kind and pipeline shape (and, for MoE, each
    all-to-all overlap), valid or not: the same figures, or the same refusal."""
    spec = load_runspec(EXAMPLES / base)
    plan = replace(spec.plan(), **extra)
    a2a = MOE_A2A_OVERLAPS if spec.model.is_moe else ("none",)
    for zero, rec, (pp, vpp, sched), overlap in itertools.product(*GRID.values(), a2a):
        p = replace(
            plan,
            zero_stage=zero,
            recompute=rec,
            pp=pp,
            vpp=vpp,
            pp_schedule=sched,
            moe_a2a_overlap=overlap,
            dp=plan.dp * plan.pp // pp,
            offload_layers=plan.offload_layers if pp == 1 else 0,
        )
        check_plan(spec, p)
        try:
            validate_plan(p, spec.model, spec.cluster)
        except SpecError:
            check_plan(spec, p, check=False)  # what a check=False caller gets


LAYER_MODELS = ("gpt3-175b", "llama3-8b", "mixtral-8x7b", "deepseek-v3", "gpt-oss-120b")
TRAINING = (
    {},
    {"attention": "flash2", "dropout": 0.1, "precision": "fp8"},
    {"attention": "flex"},
    {"attention": "triton"},
    {"attention": "flash1"},
    {"attention": "unfused", "dropout": 0.1, "fused_kernels": False},
)


@pytest.mark.parametrize("model_name", LAYER_MODELS)
def test_layer_times_split_into_kernel_classes_as_before(model_name: str) -> None:
    """compute.layer_times, now a sum of kernel-class terms, against the function it was: every
    field of LayerTimes equal, dense and MoE layers, MLA, each attention kind, fused or eager,
    FP8, recompute modules, over TP / CP / micro-batch / SP / EP / ETP shapes. Sliding-window
    layers, priced since (tests/perf/test_attention_window.py), are left out: the function it was
    priced every layer as full attention."""
    for training, (tp, cp, mbs, sp, ep, etp) in itertools.product(
        TRAINING, ((1, 1, 1, False, 1, 1), (8, 2, 2, True, 8, 1), (4, 1, 4, False, 2, 2))
    ):
        spec = runspec_from_dict(
            {
                "model": {"preset": model_name},
                "cluster": {"gpu": "h100-sxm", "num_gpus": 64, "gpus_per_node": 8},
                "parallel": {"global_batch_size": 64},
                "training": training,
            }
        )
        modules = ("mla_up_proj", "moe_act", "layernorm", "mlp")
        plan = ParallelPlan(
            tp=tp, cp=cp, micro_batch_size=mbs, sequence_parallel=sp, ep=ep, etp=etp
        )
        for plan_modules, moe in itertools.product(((), modules), (False, True)):
            if moe and not spec.model.is_moe:
                continue
            p = replace(plan, recompute_modules=plan_modules)
            model = replace(spec.model, attention_window=None, full_attention_every=0)
            args = (model, spec.cluster.gpu, p, spec.training, DEFAULT_PARAMS, None, moe)
            assert compute.layer_times(*args) == scalar_layer_times(*args), (p, training, moe)
