"""The [rl] response lengths as the rollout prices them (perf/rl/rollout.py): response_len is
the mean of responses already cut at max_response_len, so the lognormal's own mean is set for
its capped draws to average that many tokens."""

from __future__ import annotations

import math

import numpy as np
import pytest

from aihpc.perf.rl.rollout import capped_lognormal_mean, length_dist, uncapped_mean
from aihpc.runspec.rl import RLSpec


@pytest.mark.parametrize(("mean", "sigma", "cap"), [(3000, 0.8, 3946), (550, 0.8, 1386)])
def test_capped_mean_is_the_mean_of_capped_draws(mean, sigma, cap):
    mu = math.log(mean) - sigma**2 / 2
    draws = np.random.default_rng(7).lognormal(mu, sigma, 2_000_000)
    sampled = float(np.minimum(draws, cap).mean())
    standard_error = float(np.minimum(draws, cap).std()) / math.sqrt(len(draws))
    assert abs(capped_lognormal_mean(mean, sigma, cap) - sampled) < 5 * standard_error
    assert capped_lognormal_mean(mean, sigma, 1e12) == pytest.approx(mean)


def test_uncapped_mean_inverts_the_cap():
    own = uncapped_mean(5548, 0.8, 8042)
    assert own > 5548  # the cap cuts the tail, so the lognormal itself is longer
    assert capped_lognormal_mean(own, 0.8, 8042) == pytest.approx(5548, rel=1e-9)
    assert uncapped_mean(8042, 0.8, 8042) == 8042  # every response at the cap


@pytest.mark.parametrize("dist", ["lognormal", "uniform", "fixed"])
def test_priced_lengths_average_the_published_mean(dist):
    rl = RLSpec(
        prompts_per_step=64,
        samples_per_prompt=32,
        prompt_len=150,
        response_len=3053,
        max_response_len=3946,
        response_dist=dist,
    )
    lengths = length_dist(rl).quantiles(20_000)
    assert lengths.max() <= 3946
    assert float(lengths.mean()) == pytest.approx(3053, rel=2e-3)
