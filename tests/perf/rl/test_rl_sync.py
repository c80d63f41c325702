"""weight_sync = "full": every rollout GPU receives every full tensor (perf/rl/phases.py,
``full_sync_bytes_s``), checked against what the bytes must cross, not against measured runs."""

from __future__ import annotations

from dataclasses import replace

import pytest
from rl_base_spec import base_spec as _spec

from aihpc.perf.rl.phases import full_sync_bytes_s, sync_bytes, sync_s
from aihpc.runspec import SpecError
from aihpc.runspec.parallel import ParallelPlan


def test_disaggregated_full_sync_moves_the_whole_model_to_every_rollout_gpu():
    spec = _spec(placement="disaggregated", rollout_gpus=16, weight_sync="full")
    shard = _spec(placement="disaggregated", rollout_gpus=16, weight_sync="nccl")
    assert spec.rl is not None and shard.rl is not None
    nic = spec.cluster.scale_out_bw_GBps * 1e9
    full = full_sync_bytes_s(spec.model, spec.cluster, spec.rl, 16)
    assert full == pytest.approx(sync_bytes(spec.model, spec.rl) / nic)
    # against shard-to-shard: each GPU receives gpus_per_engine times the bytes
    host_and_shard = sync_s(shard.model, shard.cluster, shard.rl, 16)
    assert sync_s(spec.model, spec.cluster, spec.rl, 16) > host_and_shard


def test_colocated_full_sync_gathers_what_the_gpu_does_not_train():
    spec = _spec(weight_sync="full")
    assert spec.rl is not None
    total = sync_bytes(spec.model, spec.rl)
    cl = spec.cluster

    def t(plan):
        return full_sync_bytes_s(spec.model, cl, spec.rl, 32, plan)

    # every GPU trains the whole model (data parallel only): nothing to gather
    assert t(ParallelPlan()) == 0.0
    # eight expert ranks in one NVLink domain: 7/8 of the model over NVLink
    assert t(ParallelPlan(ep=8)) == pytest.approx(total * 7 / 8 / (cl.scale_up_bw_GBps * 1e9))
    # two pipeline stages: the other stage lives on other nodes, so the NIC carries it
    across = t(ParallelPlan(ep=8, pp=2))
    assert across == pytest.approx(total * 15 / 16 / (cl.scale_out_bw_GBps * 1e9))
    assert across > t(ParallelPlan(ep=8))


def test_full_sync_is_a_choice_for_either_placement_and_named_when_wrong():
    assert _spec(weight_sync="full").rl.sync_method == "full"
    assert _spec(placement="disaggregated", rollout_gpus=16, weight_sync="full").rl
    with pytest.raises(SpecError) as err:
        _spec(weight_sync="nccl")
    assert "full" in str(err.value)


def test_the_step_prices_the_full_sync_of_its_own_training_plan():
    from aihpc.perf.rl import estimate_rl

    full = estimate_rl(_spec(weight_sync="full"))
    ipc = estimate_rl(_spec(weight_sync="cuda_ipc"))
    assert full.phases_s["weight_sync"] > ipc.phases_s["weight_sync"]
    dp_only = replace(full.plan, ep=1)
    assert (
        estimate_rl(_spec(weight_sync="full"), dp_only).phases_s["weight_sync"]
        < (full.phases_s["weight_sync"])
    )
