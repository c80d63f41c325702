"""The RL rollout phase: the last response sets the phase, a longer tail costs time at the same
mean length, memory beside the training state limits the batch, and more engines share it."""

from __future__ import annotations

import pytest

from aihpc.perf.infer.estimate import engine_for
from aihpc.perf.infer.kernels import Work
from aihpc.perf.infer.kv import ServingPlan
from aihpc.perf.infer.rollout import LengthDist, estimate_rollout, live_peak_tokens
from aihpc.perf.infer.step import step_time
from aihpc.runspec import SpecError
from aihpc.runspec.cluster import gpu_from_id
from aihpc.runspec.model import model_from_table

MODEL = model_from_table({"preset": "llama3-8b"})
H100 = gpu_from_id("h100-sxm")
PLAN = ServingPlan(tp=1)


def roll(response: LengthDist, **kw):
    args = {"prompts": 64, "samples": 8, "prompt_len": 512, "instances": 4}
    return estimate_rollout(MODEL, H100, PLAN, response=response, **{**args, **kw})


def test_a_longer_tail_at_the_same_mean_takes_longer() -> None:
    narrow = roll(LengthDist(kind="lognormal", mean=1500, sigma=0.2))
    wide = roll(LengthDist(kind="lognormal", mean=1500, sigma=1.0))
    assert wide.longest_response > narrow.longest_response
    assert wide.phase_s > narrow.phase_s
    assert wide.tail_share > narrow.tail_share
    assert wide.tokens_per_s_per_gpu < narrow.tokens_per_s_per_gpu


def test_the_last_sequence_bounds_the_phase_from_below() -> None:
    r = roll(LengthDist(kind="uniform", low=100, high=3000))
    e, cluster = engine_for(MODEL, H100, PLAN)
    one_step = step_time(e, cluster, Work(decode_seqs=1, decode_ctx=0)).total
    assert r.phase_s >= r.longest_response * one_step  # its tokens come one step at a time
    assert r.mean_finish_s < r.phase_s
    # the top quantile of the whole step's responses, whichever instance holds it
    assert r.longest_response == 3000 - round(2900 / (2 * r.sequences))


def test_the_length_cap_bounds_the_longest_response() -> None:
    capped = roll(LengthDist(kind="lognormal", mean=1500, sigma=1.2, max_len=4096))
    free = roll(LengthDist(kind="lognormal", mean=1500, sigma=1.2, max_len=65536))
    assert capped.longest_response == 4096
    assert capped.phase_s < free.phase_s


def test_memory_beside_the_training_state_limits_the_batch() -> None:
    fixed = LengthDist(kind="fixed", mean=2048)
    roomy = roll(fixed, gpu_memory_utilization=0.9)
    colocated = roll(fixed, gpu_memory_utilization=0.9, training_state_gib=40)
    assert colocated.kv_capacity_gib < roomy.kv_capacity_gib
    assert colocated.batch < roomy.batch
    assert colocated.phase_s > roomy.phase_s


def test_more_engine_instances_shorten_the_phase() -> None:
    fixed = LengthDist(kind="fixed", mean=1024)
    assert roll(fixed, instances=8).phase_s < roll(fixed, instances=2).phase_s


def test_the_steps_longest_response_ends_the_phase_however_it_is_split() -> None:
    """Splitting the step's responses over more instances does not shorten its longest one:
    the instance that holds it decodes it to the end (the expected maximum over all N draws,
    not over one instance's share); each instance still takes an even share of the rest."""
    wide = LengthDist(kind="lognormal", mean=400, sigma=0.8, max_len=65536)
    one, many = roll(wide, instances=1), roll(wide, instances=16)
    assert many.longest_response == one.longest_response == int(wide.quantiles(512).max())

    # an even share of the rest (n quantiles), so holding the longest it generates more than
    # an average share, and less than the whole step's mean plus that longest response
    share = wide.quantiles(many.sequences // 16)
    assert share.mean() < many.mean_response < share.mean() + many.longest_response / len(share)
    e, cluster = engine_for(MODEL, H100, PLAN)
    one_step = step_time(e, cluster, Work(decode_seqs=1, decode_ctx=0)).total
    assert many.phase_s >= many.longest_response * one_step


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"samples": 0}, "rollout.samples"),
        ({"gpu_memory_utilization": 0}, "rollout.gpu_memory_utilization"),
        ({"training_state_gib": 500}, "rollout.training_state_gib"),
        ({"response": LengthDist(kind="pareto")}, "rollout.response.kind"),
        ({"response": LengthDist(sigma=-1)}, "rollout.response.sigma"),
        ({"gpu_memory_utilization": 0.05}, "rollout.gpu_memory_utilization"),  # weights alone
    ],
)
def test_bad_input_is_one_line_naming_the_field(kw: dict, field: str) -> None:
    args = {"response": LengthDist(), **kw}
    with pytest.raises(SpecError) as err:
        roll(**args)
    assert str(err.value).startswith(field)


def test_live_peak_counts_the_tokens_held_at_the_fullest_step() -> None:
    """Started together, the sequences still running at step t hold t tokens each (a finished
    one has freed its pages): the peak, counted step by step, is what live_peak_tokens gives,
    and never more than the whole share held at once."""
    dist = LengthDist(kind="lognormal", mean=300, sigma=1.0, max_len=2000)
    lengths = dist.quantiles(40).round()  # whole tokens: a response of L holds L at its last step
    counted = max(t * int((lengths >= t).sum()) for t in range(1, int(lengths.max()) + 1))
    assert live_peak_tokens(lengths) == pytest.approx(counted, abs=1.0)
    assert live_peak_tokens(lengths) < lengths.sum()
    fixed = [500.0] * 8  # every sequence runs to the end: all of them held at the last step
    assert live_peak_tokens(fixed) == 8 * 500
    assert live_peak_tokens(fixed, block_size=16) == 8 * (500 + 15)


def test_a_share_whose_live_peak_fits_runs_at_once() -> None:
    """At the same mean length, responses of spread lengths started together hold far fewer
    pages at their fullest step than the same number at the mean, so where the KV cache holds
    that peak the whole share runs at once; fixed lengths hold every page to the end and are
    admitted as the cache allows."""
    kw = {"gpu_memory_utilization": 0.9, "training_state_gib": 30}
    fixed = roll(LengthDist(kind="fixed", mean=3000, max_len=16384), **kw)
    spread = roll(LengthDist(kind="lognormal", mean=3000, sigma=1.0, max_len=16384), **kw)
    share = fixed.sequences // 4
    assert fixed.kv_capacity_gib == spread.kv_capacity_gib
    assert fixed.batch < share  # 3,000 x the share's sequences does not fit
    assert spread.batch == share
