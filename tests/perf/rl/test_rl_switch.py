"""The colocated switch (perf/rl/switch.py): the bytes each NeMo-RL call moves per GPU, counted
from the model and the layout here, independently of the step model's memory terms, and each
copy's rate taken from perf/rl/data/overheads.toml (pageable) or the GPU's host link (pinned)."""

from __future__ import annotations

import copy
import tomllib
from importlib import resources

import pytest
from rl_base_spec import BASE
from rl_base_spec import base_spec as _spec

from aihpc.perf.fit.rl_validate import validate_phases
from aihpc.perf.rl import estimate_rl
from aihpc.perf.rl.overheads import host_rates
from aihpc.perf.rl.step import TRAIN_SIDE
from aihpc.perf.rl.switch import (
    MASTER_REMAINDER_BYTES,
    TIMERS,
    colocated_moves,
    optimizer_state_bytes,
    price_switch,
)
from aihpc.perf.step.flops import expert_params_per_layer, num_params
from aihpc.runspec import runspec_from_dict
from aihpc.runspec.cluster import gpu_from_id
from aihpc.runspec.errors import SpecError

# Adam's two fp32 moments, plus the fp32 master's 16-bit remainder (Megatron's precision-aware
# optimizer, store_param_remainders): what move_optimizer moves per parameter of the shard.
STATE_BYTES_PER_PARAM = 4 + 4 + MASTER_REMAINDER_BYTES


def _dense_spec(zero_stage: int = 1, **rl):
    """Llama 3 8B on 8 H100, data parallel only, engines of one GPU."""
    data = copy.deepcopy(BASE)
    data["model"]["preset"] = "llama3-8b"
    data["parallel"] = {"global_batch_size": 512, "zero_stage": zero_stage}
    data["cluster"]["num_gpus"] = 8
    data["rl"]["rollout"] = {"tp": 1}
    data["rl"].update(rl)
    return runspec_from_dict(data)


def _moves(spec):
    est = estimate_rl(spec)
    return est, colocated_moves(est.actor.estimate, spec.model, spec.rl, spec.training)


def _by_what(moves, word, to_host):
    (move,) = [m for m in moves if word in m.what and m.to_host == to_host]
    return move


def test_a_dense_layout_moves_its_parameters_state_and_engine_weights():
    spec = _dense_spec()
    _, moves = _moves(spec)
    p, dp = num_params(spec.model), 8
    for to_host in (True, False):
        assert _by_what(moves, "parameters", to_host).bytes == pytest.approx(2 * p, rel=1e-5)
        assert _by_what(moves, "parameters", to_host).kind == "pinned"
        state = _by_what(moves, "optimizer", to_host)
        assert state.bytes == pytest.approx(p / dp * STATE_BYTES_PER_PARAM, rel=1e-5)
        assert state.kind == "pageable"  # .to("cpu") into fresh memory, .to("cuda") back
        engine = _by_what(moves, "engine", to_host)
        assert engine.bytes == pytest.approx(2 * p, rel=1e-5)  # bf16, one GPU an engine
        assert engine.kind == "pinned"  # vLLM's backup is torch.empty(pin_memory=True)
    # each direction once a step, under the NeMo-RL timer the call runs in
    assert sorted(m.timer for m in moves) == sorted([TIMERS[0]] * 3 + list(TIMERS[1:]))


def test_experts_shard_their_state_over_the_expert_data_parallel_ranks():
    spec = _spec()  # Qwen3-30B-A3B, 32 GPUs, dp 32, ep 8; engines of 2 GPUs
    _, moves = _moves(spec)
    p = num_params(spec.model)
    experts = spec.model.num_moe_layers * expert_params_per_layer(spec.model)
    dense = p - experts
    edp = 32 // 8
    shard = dense / 32 + experts / 8 / edp
    state = _by_what(moves, "optimizer", True)
    assert state.bytes == pytest.approx(shard * STATE_BYTES_PER_PARAM, rel=1e-5)
    params = _by_what(moves, "parameters", True)
    assert params.bytes == pytest.approx(2 * (dense + experts / 8), rel=1e-5)
    # each engine GPU backs up its tp-shard of the whole model
    assert _by_what(moves, "engine", True).bytes == pytest.approx(2 * p / 2, rel=1e-5)


def test_each_rate_comes_from_the_data_files():
    text = resources.files("aihpc.perf.rl").joinpath("data/overheads.toml").read_text()
    rows = {r["host"]: r for r in tomllib.loads(text)["host_copy"]}
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    for row in rows.values():
        for gpu_id in row["gpus"]:
            gpu = gpu_from_id(gpu_id)
            r = host_rates(_spec(gpu=gpu_id).cluster)
            assert r.measured_pageable
            assert r.pinned_d2h == r.pinned_h2d == gpu.host_link_GBps
            assert r.pageable_d2h == pytest.approx(
                min(mean(row["pageable_d2h_GBps"]), r.pinned_d2h)
            )
            assert r.pageable_h2d == pytest.approx(
                min(mean(row["pageable_h2d_GBps"]), r.pinned_h2d)
            )
    # a GPU no row names: its host's pageable copies at the pinned rate (a lower bound)
    a100 = gpu_from_id("a100-80gb")
    r = host_rates(_spec(gpu="a100-80gb").cluster)
    assert not r.measured_pageable and r.pageable_d2h == r.pinned_d2h == a100.host_link_GBps


def test_the_switch_is_its_moves_at_their_rates():
    spec = _spec()
    est, moves = _moves(spec)
    rates = host_rates(spec.cluster)
    expected = 0.0
    for m in moves:
        if m.kind == "pinned":
            rate = rates.pinned_d2h if m.to_host else rates.pinned_h2d
        else:
            rate = rates.pageable_d2h if m.to_host else rates.pageable_h2d
        expected += m.bytes / (rate * 1e9)
    assert est.phases_s["switch"] == pytest.approx(expected)
    assert sum(est.switch_by_timer.values()) == pytest.approx(expected)
    # on an x86 host the optimizer's pageable round trip is most of it
    pageable = sum(m.bytes for m in moves if m.kind == "pageable")
    assert pageable / (rates.pageable_d2h * 1e9) > 0.5 * expected


def test_nothing_moves_when_the_pools_are_apart():
    spec = _spec(placement="disaggregated", rollout_gpus=16)
    est, moves = _moves(spec)
    assert moves == [] and est.phases_s["switch"] == 0.0
    s = price_switch(est.actor.estimate, spec.model, spec.cluster, spec.rl, spec.training)
    assert s.seconds == 0.0 and s.to_host_gib == 0.0


def test_the_blog_refit_phase_carries_the_copies_made_under_its_timer():
    """NeMo-RL's prepare_for_generation timer holds the optimizer's offload, the engine's wake
    and the parameters' offload beside the refit itself: the phase table adds them."""
    for row in validate_phases():
        assert row.predicted["refit"] > 0.0
    # the refit of the blog's Llama 3.1-8B (one node, no sync traffic to price) is the copies
    (llama,) = [r for r in validate_phases() if r.id == "nemorl03-llama8b-8"]
    assert llama.predicted["refit"] > 1.0


def test_the_logprob_offload_moves_the_state_when_the_pools_are_apart():
    """NeMo-RL through v0.4.0: prepare_for_lp_inference moved the optimizer state out in every
    placement and prepare_for_training brought it back, on the training side of the step."""
    base = {"placement": "disaggregated", "rollout_gpus": 16}
    off = estimate_rl(_spec(**base, offload_optimizer_for_logprob=True))
    kept = estimate_rl(_spec(**base))
    assert kept.phases_s["optimizer_offload"] == 0.0
    spec = _spec(**base, offload_optimizer_for_logprob=True)
    state = optimizer_state_bytes(off.actor.estimate, spec.training)
    rates = host_rates(spec.training_cluster())
    expected = state / (rates.pageable_d2h * 1e9) + state / (rates.pageable_h2d * 1e9)
    assert off.phases_s["optimizer_offload"] == pytest.approx(expected)
    assert "optimizer_offload" in TRAIN_SIDE  # paid by the training pool, also when async
    # colocated, the switch has moved it out already: nothing more
    colocated = estimate_rl(_spec(offload_optimizer_for_logprob=True))
    assert colocated.phases_s["optimizer_offload"] == 0.0
    assert colocated.step_time_s == pytest.approx(estimate_rl(_spec()).step_time_s)


def test_verl_megatron_moves_its_state_inside_the_log_prob_and_update_phases():
    """verl at 588f972 with param/grad/optimizer offload: the 16-bit parameters come in pinned
    and go out pageable (``.cpu().pin_memory()``) once in the reshard, once in old_log_prob and
    once in update_actor; the optimizer's fp32 master and two moments come in and go out pinned
    (non_blocking ``.to``) once, in update_actor; the engine's weights as in NeMo-RL."""
    spec = _dense_spec()  # Llama 3 8B on 8 H100, dp 8, engines of one GPU
    est = estimate_rl(spec)
    verl = estimate_rl(_dense_spec(offload="verl-megatron"))
    p, dp = num_params(spec.model), 8
    weights, state, engine = 2 * p, p / dp * (4 + 4 + 4), 2 * p
    rates = host_rates(spec.training_cluster())
    pin, page = rates.pinned_d2h * 1e9, rates.pageable_d2h * 1e9
    assert rates.pinned_h2d == rates.pinned_d2h  # one pinned rate both ways below
    params_round_trip = weights / pin + weights / page
    lp = verl.switch_by_timer["old_log_prob"]
    update = verl.switch_by_timer["update_actor"]
    assert lp == pytest.approx(params_round_trip, rel=1e-4)
    assert update == pytest.approx(params_round_trip + 2 * state / pin, rel=1e-4)
    reshard = params_round_trip + engine / pin
    assert verl.switch_by_timer["reshard"] == pytest.approx(reshard, rel=1e-4)
    assert verl.switch_by_timer["gen"] == pytest.approx(engine / pin, rel=1e-4)
    # the in-phase moves are in their phases, not in the switch; the GPU work is the same
    assert verl.phases_s["switch"] == pytest.approx(reshard + engine / pin, rel=1e-4)
    assert verl.phases_s["old_logprob"] == pytest.approx(est.phases_s["old_logprob"] + lp)
    assert verl.phases_s["update"] == pytest.approx(est.phases_s["update"] + update)
    assert verl.rollout.time_s == est.rollout.time_s


def test_verl_fsdp_moves_the_fp32_shard_and_the_moments_pinned_or_pageable_by_version():
    """verl's FSDP workers (fsdp_utils.py): the sharded fp32 parameter (FSDP's master) and Adam's
    two moments, counted here from the parameter count; FSDP1 moves the parameters by
    ``flat_param_to(non_blocking=True)`` (pinned), FSDP2 at b178a3c by ``model.cpu()`` and
    ``model.to(device)`` (pageable); the moments are pinned in both."""
    spec = _dense_spec(zero_stage=3)
    p, dp = num_params(spec.model), 8
    shard, moments = 4 * p / dp, 8 * p / dp
    rates = host_rates(spec.training_cluster())
    pin, page_out, page_in = (
        rates.pinned_d2h * 1e9,
        rates.pageable_d2h * 1e9,
        rates.pageable_h2d * 1e9,
    )
    fsdp1 = estimate_rl(_dense_spec(zero_stage=3, offload="verl-fsdp")).switch_by_timer
    fsdp2 = estimate_rl(_dense_spec(zero_stage=3, offload="verl-fsdp2")).switch_by_timer
    assert fsdp1["old_log_prob"] == pytest.approx(2 * shard / pin, rel=1e-4)
    assert fsdp1["update_actor"] == pytest.approx((2 * shard + 2 * moments) / pin, rel=1e-4)
    assert fsdp2["old_log_prob"] == pytest.approx(shard / page_in + shard / page_out, rel=1e-4)
    assert fsdp2["update_actor"] == pytest.approx(
        shard / page_in + shard / page_out + 2 * moments / pin, rel=1e-4
    )


def test_no_offload_moves_only_the_engine_and_must_leave_the_engine_its_memory():
    """``offload = "none"`` (verl with its offloads off): the engine's weights sleep and wake,
    nothing of the training state moves; the state the GPU keeps must fit beside the engine's
    ``gpu_memory_utilization`` share of the GPU."""
    spec = _dense_spec(zero_stage=3, offload="none")
    est = estimate_rl(spec)
    engine = 2 * num_params(spec.model)  # one-GPU engines hold the whole bf16 model
    pin = host_rates(spec.training_cluster()).pinned_d2h * 1e9
    assert est.phases_s["switch"] == pytest.approx(2 * engine / pin, rel=1e-4)
    assert est.switch_by_timer["old_log_prob"] == est.switch_by_timer["update_actor"] == 0.0
    assert est.fits
    # 8B at ZeRO-1 over 8 GPUs keeps 16-bit weights, fp32 gradients and its optimizer shard
    # (tens of GiB) while the engine takes 95% of 80 GiB: it cannot stay
    crowded = _dense_spec(offload="none", rollout={"tp": 1, "gpu_memory_utilization": 0.95})
    est = estimate_rl(crowded)
    assert not est.fits
    (note,) = [n for n in est.notes if "rl.offload" in n]
    assert "gpu_memory_utilization 0.95" in note


def test_verl_offload_apart_moves_only_the_workers_own_and_refuses_other_names():
    """Disaggregated, verl's actor worker still moves its state around compute_log_prob and
    update_actor; there is no reshard on the training GPUs and no engine sleeping there."""
    spec = _spec(placement="disaggregated", rollout_gpus=16, offload="verl-megatron")
    plain = estimate_rl(_spec(placement="disaggregated", rollout_gpus=16))
    verl = estimate_rl(spec)
    assert verl.phases_s["switch"] == 0.0
    assert verl.switch_by_timer["reshard"] == verl.switch_by_timer["gen"] == 0.0
    assert verl.switch_by_timer["update_actor"] > verl.switch_by_timer["old_log_prob"] > 0
    assert verl.phases_s["update"] == pytest.approx(
        plain.phases_s["update"] + verl.switch_by_timer["update_actor"]
    )
    with pytest.raises(SpecError) as err:
        _spec(offload="openrlhf")
    assert err.value.field == "rl.offload"
    with pytest.raises(SpecError) as err:
        _spec(offload="verl-megatron", offload_optimizer_for_logprob=True)
    assert err.value.field == "rl.offload_optimizer_for_logprob"


def test_slime_moves_its_optimizer_through_the_memory_savers_pinned_backup():
    """slime's --colocate (THUDM/slime 624b824 with torch_memory_saver): the optimizer's fp32
    master and two moments out at sleep and in at wake_up, the 16-bit parameters restored from
    slime's pinned copy at wake_up, copied to it after the update and onto the GPU again for the
    refit's IPC handles; all pinned; the engine's weights are discarded, not copied; nothing when
    the pools are apart. Its reference swap is two copies of the weights, not three."""
    spec = _dense_spec(offload="slime")  # Llama 3 8B on 8 H100, dp 8, ZeRO-1
    slime = estimate_rl(spec)
    nemo = estimate_rl(_dense_spec())
    p, dp = num_params(spec.model), 8
    weights, state = 2 * p, p / dp * (4 + 4 + 4)
    pin = host_rates(spec.training_cluster()).pinned_d2h * 1e9
    by = slime.switch_by_timer
    assert by["wake_up"] == pytest.approx((state + weights) / pin, rel=1e-4)
    assert by["backup"] == by["update_weights"] == pytest.approx(weights / pin, rel=1e-4)
    assert by["sleep"] == pytest.approx(state / pin, rel=1e-4)
    assert slime.phases_s["switch"] == pytest.approx(sum(by.values()))
    link = spec.cluster.gpu.host_link_GBps * 1e9
    one_copy = slime.actor.estimate.memory.weights / link
    assert nemo.phases_s["ref_logprob"] - slime.phases_s["ref_logprob"] == pytest.approx(one_copy)
    apart = estimate_rl(_spec(placement="disaggregated", rollout_gpus=16, offload="slime"))
    assert apart.switch_by_timer == {} and apart.phases_s["switch"] == 0.0
