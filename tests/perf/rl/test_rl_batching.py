"""The RL update's and log-prob passes' micro-batches as NeMo-RL forms them (perf/rl/batching.py)
and the reference policy's swap through host memory, each checked against its definition."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from aihpc.perf.rl import estimate_rl
from aihpc.perf.rl.batching import (
    batches,
    first_fit_decreasing,
    pad_unit,
    sequence_lengths,
)
from aihpc.perf.rl.phases import reference_swap_s
from aihpc.perf.rl.rollout import length_dist
from aihpc.runspec import SpecError, runspec_from_dict

BASE = {
    "model": {"preset": "llama3-8b"},
    "cluster": {"gpu": "h100-sxm", "num_gpus": 8},
    "parallel": {"global_batch_size": 512},
    "rl": {
        "prompts_per_step": 64,
        "samples_per_prompt": 32,
        "prompt_len": 150,
        "response_len": 800,
        "max_response_len": 3946,
        "rollout": {"tp": 1},
    },
}


def _spec(parallel=None, **rl):
    data = copy.deepcopy(BASE)
    data["rl"].update(rl)
    data["parallel"].update(parallel or {})
    return runspec_from_dict(data)


def test_first_fit_decreasing_fills_bins_as_defined():
    # decreasing: 7 opens a bin, 5 opens one (12 > 10), 3 joins 7, 2 joins 5, 2 joins 5
    assert first_fit_decreasing(np.array([2, 5, 3, 7, 2]), 10) == [10, 9]
    # a sequence longer than a bin gets one of its own
    assert first_fit_decreasing(np.array([12, 1]), 10) == [12, 1]
    lengths = np.array([3, 9, 4, 4, 6, 1, 8])
    bins = first_fit_decreasing(lengths, 10)
    assert sum(bins) == lengths.sum() and max(bins) <= 10
    assert len(bins) >= int(np.ceil(lengths.sum() / 10))  # no fewer than the volume bound


def _first_fit_by_scan(lengths: np.ndarray, capacity: float) -> list[float]:
    """First fit decreasing as defined: each sequence, longest first, into the first open bin
    with room for it, scanning the bins in order."""
    bins: list[float] = []
    for length in sorted(lengths.tolist(), reverse=True):
        for i, used in enumerate(bins):
            if used + length <= capacity:
                bins[i] = used + length
                break
        else:
            bins.append(length)
    return bins


@pytest.mark.parametrize("n,capacity", [(1, 10), (7, 10), (300, 100), (2000, 8192)])
def test_first_fit_decreasing_equals_the_scan_it_speeds_up(n: int, capacity: int):
    lengths = np.random.default_rng(n).integers(1, 2 * capacity // 3, size=n).astype(float)
    assert first_fit_decreasing(lengths, capacity) == _first_fit_by_scan(lengths, capacity)


def test_pad_unit_follows_tp_and_context_parallelism():
    spec = _spec({"tp": 2})
    assert pad_unit(spec.plan()) == 2
    spec = _spec({"tp": 2, "cp": 2})
    assert pad_unit(spec.plan()) == 8  # 2 x cp x tp
    lengths = sequence_lengths(spec.rl, 64, 8)
    assert np.all(lengths % 8 == 0) and np.all(lengths >= spec.rl.prompt_len)


def test_packed_bins_keep_every_token_and_the_attention_of_each_sequence():
    spec = _spec()
    plan, rl = spec.plan(), spec.rl
    b = batches(rl, plan, 512)
    lengths = sequence_lengths(rl, 512, pad_unit(plan))
    capacity = rl.prompt_len + rl.response_cap  # mbs 1 x max_total_sequence_length
    bins = first_fit_decreasing(lengths, capacity)
    assert b.microbatches == -(-len(bins) // plan.dp)  # round-robin: the busiest rank
    # a micro-batch priced as mbs sequences of seq: its tokens are a mean bin's (rounded up)
    assert b.seq * b.mbs >= sum(bins) / len(bins)
    assert b.seq * b.mbs <= sum(bins) / len(bins) + b.mbs * 2 * plan.cp * plan.tp
    # and its attention (mbs x seq^2) that of the packed sequences (sum of L^2), not one of seq
    attention_len = np.sum(lengths**2) / np.sum(lengths)
    assert b.seq == pytest.approx(attention_len, rel=0.25)
    assert b.seq < capacity
    assert b.useful == pytest.approx(1.0, abs=0.01)  # no pipeline: no padding


def test_pipeline_pads_every_packed_microbatch_to_the_longest_bin():
    spec = _spec({"pp": 2})
    plan, rl = spec.plan(), spec.rl
    b = batches(rl, plan, 512)
    bins = first_fit_decreasing(sequence_lengths(rl, 512, pad_unit(plan)), 4096)
    assert b.seq * b.mbs >= max(bins)
    assert b.useful == pytest.approx(sum(bins) / (max(bins) * len(bins)), rel=1e-6)
    assert b.useful < 1.0


def test_variable_seq_lengths_let_each_pipeline_microbatch_cost_its_own_tokens():
    """Megatron's variable_seq_lengths (verl, slime): the stages exchange each micro-batch's
    shape, so under pipeline parallelism a packed bin is as full as the mean, an unpadded one
    holds its own sequences, as without a pipeline; the update costs less than padded bins."""
    for how, mbs in (("packed", 1), ("unpadded", 2)):
        flat = batches(_spec({"micro_batch_size": mbs}).rl, _spec().plan(), 512, how, mbs)
        static = _spec({"pp": 2, "micro_batch_size": mbs})
        varied = _spec({"pp": 2, "micro_batch_size": mbs}, variable_seq_lengths=True)
        padded = batches(static.rl, static.plan(), 512, how, mbs)
        own = batches(varied.rl, varied.plan(), 512, how, mbs)
        assert own.seq * own.mbs == flat.seq * flat.mbs and own.useful == flat.useful
        assert padded.seq * padded.mbs > own.seq * own.mbs
        fast, slow = estimate_rl(varied), estimate_rl(static)
        assert fast.phases_s["update"] < slow.phases_s["update"]
    with pytest.raises(SpecError) as err:
        _spec(variable_seq_lengths="yes")
    assert err.value.field == "rl.variable_seq_lengths"


def test_padded_batches_pad_to_the_longest_of_the_batch():
    spec = _spec()
    plan, rl = spec.plan(), spec.rl
    b = batches(rl, plan, 2048, "padded")
    longest = rl.prompt_len + length_dist(rl).longest(2048)
    assert longest <= b.seq < longest + pad_unit(plan) * 2
    assert b.mbs == plan.micro_batch_size
    assert b.microbatches == 2048 // plan.dp
    assert b.useful == pytest.approx((rl.prompt_len + rl.response_len) / b.seq)
    with pytest.raises(SpecError):
        batches(rl, plan, 2048, "dynamic")


def test_unpadded_batches_hold_mbs_sequences_of_their_own_lengths():
    spec = _spec({"micro_batch_size": 2})
    plan, rl = spec.plan(), spec.rl
    b = batches(rl, plan, 2048, "unpadded")
    lengths = sequence_lengths(rl, 2048, pad_unit(plan))
    assert b.microbatches == -(-2048 // (plan.dp * 2))  # ppo_micro_batch_size_per_gpu each
    tokens = b.seq * b.mbs  # a micro-batch's tokens: two mean sequences, rounded up
    assert 2 * lengths.mean() <= tokens <= 2 * lengths.mean() + b.mbs * 2 * plan.cp * plan.tp
    assert b.useful == pytest.approx(1.0, abs=0.01)  # the padding is removed
    padded = batches(rl, plan, 2048, "padded")
    assert padded.seq * padded.mbs > tokens  # where padding to the longest would cost more
    piped = batches(rl, _spec({"micro_batch_size": 2, "pp": 2}).plan(), 2048, "unpadded")
    assert piped.seq * piped.mbs >= 2 * lengths.max() and piped.useful < 1.0


def test_padding_costs_more_than_packing():
    spec = _spec()
    est = estimate_rl(spec)
    from aihpc.perf.rl.phases import price_training

    padded = price_training(
        spec.model, spec.cluster, spec.plan(), spec.training, spec.rl, batching="padded"
    )
    assert padded.update_s > est.actor.update_s
    assert padded.forward_s > est.actor.forward_s


def test_reference_swap_is_three_copies_of_the_weights_over_the_host_link():
    spec = _spec()
    est = estimate_rl(spec)
    w = est.actor.estimate.memory.weights
    link = spec.cluster.gpu.host_link_GBps
    assert reference_swap_s(est.actor.estimate, spec.cluster) == pytest.approx(3 * w / (link * 1e9))
    inproc = estimate_rl(spec, in_process=True)
    assert est.phases_s["ref_logprob"] > inproc.phases_s["ref_logprob"]
    no_kl = estimate_rl(_spec(kl=False))
    assert no_kl.phases_s["ref_logprob"] == 0.0


def test_fixed_microbatches_carry_a_note_of_the_cost_left_unpriced():
    """verl's fixed micro-batches: the estimate counts them and says what published runs show
    beyond their FLOPs; dynamic batching (packed) has no such note."""
    fixed = estimate_rl(_spec({"micro_batch_size": 2}, batching="unpadded"))
    (note,) = [n for n in fixed.notes if n.startswith("fixed micro-batches")]
    per_rank = fixed.actor.batches.microbatches * fixed.actor.optimizer_steps
    assert f"({per_rank} a rank each step)" in note and "packed" in note
    assert not [n for n in estimate_rl(_spec()).notes if n.startswith("fixed micro-batches")]
