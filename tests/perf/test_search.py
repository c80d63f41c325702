"""Search: fixed fields stay fixed, every plan is valid, ranking is by throughput."""

from aihpc.perf.estimate import estimate_plan
from aihpc.perf.search import search
from aihpc.spec import plan_problem, runspec_from_dict


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
