"""Search: fixed fields stay fixed, every plan is valid, ranking is by throughput."""

from aihpc.perf.search.ranking import search
from aihpc.perf.step.estimate import estimate_plan
from aihpc.runspec import plan_problem, runspec_from_dict


def spec(parallel):
    return runspec_from_dict(
        {
            "model": {"preset": "llama3-70b"},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 256},
            "parallel": parallel,
        }
    )


def test_fixed_fields_are_kept_and_plans_are_valid() -> None:
    s = spec({"tp": 8, "zero_stage": 1, "global_batch_size": 256})
    result = search(s)
    assert result.feasible == len(result.plans) > 0
    assert result.evaluated >= result.feasible
    for e in result.plans:
        assert e.plan.tp == 8 and e.plan.zero_stage == 1
        assert plan_problem(e.plan, s.model, s.cluster) is None
        assert e.fits


def test_a_given_schedule_and_shard_group_hold_for_every_searched_plan() -> None:
    """A requested pipeline schedule or HSDP shard group is a constraint, not a hint: the search
    used to drop both and answer a "zbv" request with interleaved plans."""
    for schedule, vpp_ok in (
        ("zbv", lambda v: v == 2),
        ("interleaved-1f1b", lambda v: v > 1),
        ("1f1b", lambda v: v == 1),
    ):
        s = spec({"pp_schedule": schedule, "global_batch_size": 256})
        result = search(s, top=50)
        assert result.plans, schedule
        for e in result.plans:
            assert e.plan.schedule == schedule and vpp_ok(e.plan.vpp), (schedule, e.plan)
            assert plan_problem(e.plan, s.model, s.cluster) is None
    s = spec({"dp_shard": 4, "global_batch_size": 256})
    result = search(s, top=50)
    assert result.plans
    for e in result.plans:
        assert e.plan.dp_shard == 4 and e.plan.dp % 4 == 0 and e.plan.zero_stage >= 1


def test_ranked_best_first_and_best_beats_a_hand_plan() -> None:
    s = spec({"global_batch_size": 256})
    result = search(s, top=20)
    speeds = [e.tokens_per_s_per_gpu for e in result.plans]
    assert speeds == sorted(speeds, reverse=True)
    hand = spec({"tp": 8, "pp": 4, "global_batch_size": 256})
    hand_est = estimate_plan(hand.model, hand.cluster, hand.plan(), hand.training)
    assert speeds[0] >= hand_est.tokens_per_s_per_gpu


def test_explain_keeps_rejected_faster_plans() -> None:
    s = spec({"tp": 1, "pp": 1, "cp": 1, "global_batch_size": 256})
    result = search(s, explain=3)
    # 70B with no model parallelism: only ZeRO-3 fits, faster-looking ZeRO-0/1 plans do not.
    assert all(e.plan.zero_stage == 3 for e in result.plans)
    assert result.rejected_best and not any(r.estimate.fits for r in result.rejected_best)
    assert all("Does not fit" in r.reason for r in result.rejected_best)


def llama405(split: str):
    return runspec_from_dict(
        {
            "model": {"preset": "llama3-405b"},  # 126 layers: no pp > 1 power of two divides it
            "cluster": {"gpu": "h100-sxm", "num_gpus": 8192},
            "parallel": {"tp": 8, "pp": 16, "zero_stage": 2, "global_batch_size": 2048},
            "training": {"pipeline_split": split},
        }
    )


def test_pipeline_split_decides_which_interleavings_are_searched() -> None:
    """torchtitan and Llama 3's stack run 126 layers on 16 x V uneven chunks; Megatron needs
    pp x vpp to divide the layers, so with pipeline_split = even no interleaving is offered."""
    uneven, even = llama405("uneven"), llama405("even")
    loose = search(uneven, top=1000, explain=1000)
    strict = search(even, top=1000, explain=1000)
    vpps = {e.plan.vpp for e in loose.plans} | {r.estimate.plan.vpp for r in loose.rejected_best}
    assert max(vpps) > 1
    assert strict.evaluated == 0  # 126 % 16 != 0: Megatron cannot run pp 16 at all
    assert (
        strict.invalid_reasons[
            "training.pipeline_split (even chunks: pp x vpp must divide the layers)"
        ]
        > 0
    )


def test_even_split_refuses_a_plan_that_does_not_divide() -> None:
    import pytest

    from aihpc.runspec import SpecError

    s = llama405("even")
    plan = s.plan()
    with pytest.raises(SpecError) as err:
        estimate_plan(s.model, s.cluster, plan, s.training)
    assert err.value.field == "parallel.pp"
    assert "divide" in str(err.value) and "\n" not in str(err.value)
    ok = llama405("uneven")
    assert estimate_plan(ok.model, ok.cluster, ok.plan(), ok.training).step_time_s > 0


def test_memoised_search_prices_every_plan_as_a_fresh_estimate() -> None:
    """The search shares kernel and collective times across plans; each ranked plan must cost
    exactly what estimate_plan gives it on its own."""
    s = spec({"global_batch_size": 256})
    result = search(s, top=50, explain=50)
    checked = [*result.plans, *(r.estimate for r in result.rejected_best)]
    assert len(checked) > 10
    for e in checked:
        fresh = estimate_plan(s.model, s.cluster, e.plan, s.training, check=False)
        assert fresh.step_time_s == e.step_time_s
        assert fresh.time_s == e.time_s
        assert fresh.memory.total == e.memory.total


def test_memo_tells_apart_every_plan_field_the_kernels_depend_on() -> None:
    """One memo shared by plans that differ in one field at a time gives each its own price."""
    from dataclasses import replace

    s = spec({"tp": 4, "pp": 2, "global_batch_size": 256})
    base = s.plan()
    variants = [
        base,
        replace(base, sequence_parallel=not base.sequence_parallel),
        replace(base, micro_batch_size=2 * base.micro_batch_size),
        replace(base, tp=2, dp=2 * base.dp),
        replace(base, recompute="full"),
        replace(base, zero_stage=3),
    ]
    memo: dict = {}
    for plan in variants:
        shared = estimate_plan(s.model, s.cluster, plan, s.training, check=False, memo=memo)
        fresh = estimate_plan(s.model, s.cluster, plan, s.training, check=False)
        assert shared.time_s == fresh.time_s
