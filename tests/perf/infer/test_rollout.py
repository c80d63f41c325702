"""The RL rollout phase: the last response sets the phase, a longer tail costs time at the same
mean length, memory beside the training state limits the batch, and more engines share it."""

from __future__ import annotations

import pytest

from aihpc.perf.infer.estimate import engine_for
from aihpc.perf.infer.kernels import Work
from aihpc.perf.infer.kv import ServingPlan
from aihpc.perf.infer.rollout import LengthDist, estimate_rollout
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
    assert r.longest_response == 3000 - round(2900 / (2 * r.sequences / 4))  # top quantile


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
