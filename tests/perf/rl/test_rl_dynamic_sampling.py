"""DAPO's dynamic sampling (``[rl] generation_batch``, ``generation_rounds``): the rollout
generates rounds of ``generation_batch`` prompts one after another, the log-prob passes and the
update see only the ``prompts_per_step`` kept; a reward model scores every generated sample."""

from __future__ import annotations

import pytest
from rl_base_spec import base_spec

from aihpc.cli.rl import estimate_lines
from aihpc.perf.rl import estimate_rl
from aihpc.runspec import SpecError


def test_a_larger_round_costs_the_rollout_less_than_its_share_and_training_nothing():
    """Three times the prompts in one round: the engines' batches fill, but the phase still
    ends with one longest response, so it costs less than three rollouts; the training side
    does not move."""
    plain = estimate_rl(base_spec())
    wide = estimate_rl(base_spec(generation_batch=3 * 64))
    assert plain.phases_s["rollout"] < wide.phases_s["rollout"] < 3 * plain.phases_s["rollout"]
    for phase in ("update", "old_logprob", "ref_logprob"):
        assert wide.phases_s[phase] == pytest.approx(plain.phases_s[phase])


def test_rounds_run_one_after_another_each_with_its_tail():
    with pytest.raises(SpecError):  # one round of 32 cannot keep 64
        base_spec(generation_batch=32)
    two = estimate_rl(base_spec(generation_batch=32, generation_rounds=2))
    half = estimate_rl(base_spec(prompts_per_step=32, samples_per_prompt=32))
    assert two.phases_s["rollout"] == pytest.approx(2 * half.phases_s["rollout"])


def test_a_reward_model_scores_every_generated_sample():
    rm = {"reward": "model", "reward_model": "qwen3-30b-a3b"}
    plain = estimate_rl(base_spec(**rm))
    wide = estimate_rl(base_spec(generation_batch=128, **rm))
    assert wide.phases_s["reward"] == pytest.approx(2 * plain.phases_s["reward"])


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"generation_batch": 0}, "rl.generation_batch"),
        ({"generation_rounds": 0}, "rl.generation_rounds"),
        ({"generation_batch": 63}, "rl.generation_batch"),
        ({"generation_batch": 16, "generation_rounds": 3}, "rl.generation_rounds"),
    ],
)
def test_fewer_generated_than_trained_is_refused_naming_the_field(fields, field):
    with pytest.raises(SpecError) as err:
        base_spec(**fields)
    assert err.value.field == field


def test_the_estimate_says_what_it_generates():
    text = "\n".join(estimate_lines(estimate_rl(base_spec(generation_batch=96))))
    assert "96 prompts generated a round, 64 of them trained on" in text
    plain = "\n".join(estimate_lines(estimate_rl(base_spec())))
    assert "generated a round" not in plain
