"""The busiest expert GPU under balanced routing (routing.py): the floor the model puts under
``moe_imbalance``, checked against a simulation of the router itself (independent random scores
through DeepSeek-V3's group-limited top-k, or a plain top-k), not against itself."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from aihpc.perf.infer.kernels import Engine, busiest_expert_share
from aihpc.perf.infer.kv import ServingPlan
from aihpc.perf.infer.routing import (
    expected_max_std_normal,
    routing_imbalance_floor,
    tokens_per_gpu_moments,
)
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec.cluster import gpu_from_id
from aihpc.runspec.model import model_from_table

DSV3 = model_from_table({"preset": "deepseek-v3"})
QWEN = model_from_table({"preset": "qwen3-30b-a3b"})  # 128 experts, top-8, no groups


def simulated_busiest(model, ep: int, tokens: int, trials: int, seed: int) -> float:
    """Mean over trials of max / mean routed copies per GPU, routing ``tokens`` with independent
    uniform scores: the best ``moe_router_group_topk`` groups by the sum of their two best scores
    (DeepSeek-V3's rule), then the top_k experts of those groups; experts in order on the GPUs."""
    rng = np.random.default_rng(seed)
    e, k = model.num_experts, model.moe_top_k
    groups, g = model.moe_router_groups, model.moe_router_group_topk
    ratios = []
    for _ in range(trials):
        s = rng.random((tokens, e))
        if groups:
            per = s.reshape(tokens, groups, e // groups)
            score = np.sort(per, axis=2)[:, :, -2:].sum(axis=2)
            best = np.argsort(-score, axis=1)[:, :g]
            keep = np.full((tokens, groups), -np.inf)
            np.put_along_axis(keep, best, 0.0, axis=1)
            s = s + np.repeat(keep, e // groups, axis=1)
        chosen = np.argsort(-s, axis=1)[:, :k]
        counts = np.bincount((chosen // (e // ep)).ravel(), minlength=ep)
        ratios.append(counts.max() / counts.mean())
    return float(np.mean(ratios))


def test_expected_maximum_of_normals_matches_the_closed_forms() -> None:
    assert expected_max_std_normal(1) == 0.0
    assert expected_max_std_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)
    # three normals: 3 / (2 sqrt(pi))
    assert expected_max_std_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi), rel=1e-6)
    values = [expected_max_std_normal(n) for n in (2, 8, 32, 144)]
    assert values == sorted(values)


@pytest.mark.parametrize(
    ("model", "ep", "tokens"),
    [(DSV3, 32, 2000), (DSV3, 8, 500), (DSV3, 4, 200), (QWEN, 8, 400)],
)
def test_floor_matches_a_simulation_of_the_router(model, ep: int, tokens: int) -> None:
    floor = routing_imbalance_floor(model, ep, tokens)
    simulated = simulated_busiest(model, ep, tokens, trials=120, seed=ep + tokens)
    assert floor > 1.0
    # the busiest GPU's excess over the mean, within the simulation's own spread
    assert floor - 1 == pytest.approx(simulated - 1, rel=0.15)


def test_group_limited_routing_spreads_a_token_less_evenly_than_plain_top_k() -> None:
    mean, var = tokens_per_gpu_moments(DSV3, 32)
    assert mean == pytest.approx(DSV3.moe_top_k / 32)
    plain = dataclasses.replace(DSV3, moe_router_groups=0, moe_router_group_topk=0)
    plain_mean, plain_var = tokens_per_gpu_moments(plain, 32)
    assert plain_mean == pytest.approx(mean)
    assert var > plain_var  # a token's copies crowd into the GPUs of its four groups


def test_floor_falls_with_tokens_and_rises_with_gpus() -> None:
    by_tokens = [routing_imbalance_floor(DSV3, 32, n) for n in (1_000, 30_000, 500_000)]
    assert by_tokens == sorted(by_tokens, reverse=True)
    assert by_tokens[-1] < 1.01  # DeepSeek's prefill step: 16K tokens on each of 32 GPUs
    # the same tokens per GPU, more GPUs: a larger maximum
    by_gpus = [routing_imbalance_floor(DSV3, ep, 100 * ep) for ep in (8, 32, 128)]
    assert by_gpus == sorted(by_gpus)
    assert routing_imbalance_floor(DSV3, 1, 1000) == 1.0
    assert routing_imbalance_floor(DSV3, 32, 0) == 1.0


def test_a_published_imbalance_above_the_floor_is_used_as_published() -> None:
    h800 = gpu_from_id("h800")
    plan = ServingPlan(dp=32, ep=32, weight_dtype="fp8")
    e = Engine(DSV3, h800, plan, DEFAULT_PARAMS)
    floor = busiest_expert_share(e, 16_384)
    assert floor == pytest.approx(routing_imbalance_floor(DSV3, 32, 16_384 * 32))
    skewed = Engine(DSV3, h800, ServingPlan(dp=32, ep=32, moe_imbalance=1.3), DEFAULT_PARAMS)
    assert busiest_expert_share(skewed, 16_384) == 1.3
    one = Engine(DSV3, h800, ServingPlan(), DEFAULT_PARAMS)
    assert busiest_expert_share(one, 16_384) == 1.0  # no expert parallelism: nothing to wait on
