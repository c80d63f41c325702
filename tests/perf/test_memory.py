"""Memory model: Korthikanti et al. 2022 Table 2 activation formulas and ZeRO state bytes."""

import pytest

from aihpc.perf.fit.validate import validate
from aihpc.perf.step.batch_memory import memory_breakdown
from aihpc.perf.step.memory import GiB, activation_bytes_per_layer
from aihpc.runspec import runspec_from_dict


def spec(
    tp=8,
    sp=False,
    recompute="none",
    mbs=2,
    dropout=0.1,
    attention="unfused",
    zero=0,
    dp=1,
    pp=1,
    gbs=None,
    **training,
):
    return runspec_from_dict(
        {
            "model": {
                "num_layers": 24,
                "hidden_size": 6144,
                "num_attention_heads": 64,
                "ffn_hidden_size": 24576,
                "vocab_size": 51200,
                "seq_length": 2048,
            },
            "cluster": {"gpu": "a100-80gb", "num_gpus": tp * dp * pp},
            "parallel": {
                "tp": tp,
                "pp": pp,
                "dp": dp,
                "sequence_parallel": sp,
                "recompute": recompute,
                "micro_batch_size": mbs,
                "zero_stage": zero,
                "global_batch_size": gbs or mbs * dp * pp,
            },
            "training": {"attention": attention, "dropout": dropout, **training},
        }
    )


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_activation_terms_follow_korthikanti_table2(tp: int) -> None:
    s, b, h, a = 2048, 2, 6144, 64
    sbh = s * b * h
    cases = {
        ("none", False): sbh * (10 + 24 / tp + 5 * a * s / (h * tp)),
        ("none", True): sbh * (34 + 5 * a * s / h) / tp,
        ("selective", False): sbh * (10 + 24 / tp),
        ("selective", True): sbh * 34 / tp,
        ("full", False): 2 * sbh,
    }
    for (recompute, sp), expected in cases.items():
        if sp and tp == 1:
            continue
        r = spec(tp=tp, sp=sp, recompute=recompute)
        got = activation_bytes_per_layer(r.model, r.plan(), r.training)
        assert got == pytest.approx(expected, rel=1e-12), (recompute, sp)


def test_flash_attention_drops_the_score_matrix() -> None:
    unfused = spec(attention="unfused")
    flash = spec(attention="flash")
    a = activation_bytes_per_layer(unfused.model, unfused.plan(), unfused.training)
    f = activation_bytes_per_layer(flash.model, flash.plan(), flash.training)
    score_bytes = 2 * 2048 * 64 * 2048 * 5 / 8  # b * a * s^2 * 5 / t
    assert a - f == pytest.approx(score_bytes, rel=0.01)


@pytest.mark.parametrize(("zero", "bytes_per_param"), [(0, 18), (1, 6 + 12 / 8), (2, 2 + 16 / 8)])
def test_zero_stage_state_bytes(zero: int, bytes_per_param: float) -> None:
    """Megatron/ZeRO: 18 B/param unsharded; 6 + 12/d (ZeRO-1); 2 + 16/d (ZeRO-2)."""
    r = spec(tp=1, zero=zero, dp=8, recompute="full")
    mb = memory_breakdown(r.model, r.cluster, r.plan(), r.training)
    from aihpc.perf.step.flops import num_params

    states = mb.weights + mb.gradients + mb.optimizer
    assert states == pytest.approx(num_params(r.model) * bytes_per_param, rel=1e-6)


@pytest.mark.parametrize(("zero", "bytes_per_param"), [(0, 10), (1, 4 + 6 / 8), (2, 2 + 8 / 8)])
def test_bf16_gradients_and_optimizer_states_halve_their_bytes(
    zero: int, bytes_per_param: float
) -> None:
    """grad_reduce_dtype = optimizer_dtype = bf16 (NeMo's grad_sync_dtype / optim.dtype):
    2 B weights + 2 B gradients + 6 B master and moments."""
    r = spec(
        tp=1, zero=zero, dp=8, recompute="full", grad_reduce_dtype="bf16", optimizer_dtype="bf16"
    )
    mb = memory_breakdown(r.model, r.cluster, r.plan(), r.training)
    from aihpc.perf.step.flops import num_params

    states = mb.weights + mb.gradients + mb.optimizer
    assert states == pytest.approx(num_params(r.model) * bytes_per_param, rel=1e-6)


def test_interleaving_cannot_hold_more_than_the_steps_chunks() -> None:
    """With as many micro-batches as stages (m = p) every chunk's forward runs before the first
    backward under interleaving too: stage 0 holds m micro-batches, the same as 1F1B."""
    base = spec(tp=8, pp=4, mbs=1, gbs=4)
    from dataclasses import replace

    plain = memory_breakdown(base.model, base.cluster, base.plan(), base.training)
    inter = memory_breakdown(base.model, base.cluster, replace(base.plan(), vpp=2), base.training)
    assert inter.activations == pytest.approx(plain.activations, rel=1e-9)


def test_interleaving_raises_first_stage_activations() -> None:
    """Korthikanti §4.2.3: interleaving multiplies stage-0 activations by 1 + (p-1)/(p v)."""
    base = spec(tp=8, pp=4, mbs=1, gbs=16)
    from dataclasses import replace

    plain = memory_breakdown(base.model, base.cluster, base.plan(), base.training)
    inter = memory_breakdown(base.model, base.cluster, replace(base.plan(), vpp=2), base.training)
    assert inter.activations / plain.activations == pytest.approx(1 + 3 / 8, rel=1e-9)


def test_korthikanti_memory_rows_within_target() -> None:
    """Issue target: Korthikanti Fig. 1 memory components within 10%."""
    report = validate()
    rows = [m for m in report.memory if "Korthikanti" in m.source]
    assert len(rows) == 12
    worst = max(abs(m.error) for m in rows)
    assert worst <= 0.10, [(m.id, m.component, f"{m.error:+.1%}") for m in rows]
    assert all(m.predicted_gib > 1 for m in rows)
    assert GiB == 2**30


def test_op_level_checkpointing_keeps_every_other_matmul_output() -> None:
    """torchtitan's op SAC on a Llama layer keeps the input, wq, wv, w1, w2 and attention
    outputs (tp = 1), far less than no recompute and more than full recompute."""
    r = runspec_from_dict(
        {
            "model": {"preset": "llama3-8b"},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 8},
            "parallel": {"recompute": "op", "global_batch_size": 8},
        }
    )
    plan = r.plan()
    h, f, hkv, tokens = 4096, 14336, 1024, 8192
    expected = tokens * (2 * h + 2 * h + 4 * 32 + 2 * (h + hkv + f + h))
    got = activation_bytes_per_layer(r.model, plan, r.training)
    assert got == pytest.approx(expected, rel=1e-12)
    none = activation_bytes_per_layer(r.model, plan, r.training, recompute="none")
    full = activation_bytes_per_layer(r.model, plan, r.training, recompute="full")
    assert full < got < none


def one_replica(preset: str, tp: int, training: dict, recompute: str, **parallel):
    """One TP group of an H100 preset model, one sequence per step."""
    return runspec_from_dict(
        {
            "model": {"preset": preset},
            "cluster": {"gpu": "h100-sxm", "num_gpus": tp},
            "parallel": {
                "tp": tp,
                "recompute": recompute,
                "micro_batch_size": 1,
                "global_batch_size": 1,
                **parallel,
            },
            "training": training,
        }
    )


@pytest.mark.parametrize("recompute", ["none", "selective", "full", "op"])
def test_repeated_kv_is_kept_where_the_attention_inputs_are(recompute: str) -> None:
    """torchtitan's repeat_kv hands SDPA K and V with every query head, and SDPA saves them for
    its backward: a GQA layer that keeps its attention inputs keeps (heads - kv_heads) more heads
    of K and V; with full or op-level checkpointing only the layer being recomputed does."""

    def act(repeat: bool) -> tuple[float, float]:
        s = one_replica("llama3-8b", 2, {"attention": "flash2", "kv_repeat": repeat}, recompute)
        per_layer = activation_bytes_per_layer(s.model, s.plan(), s.training)
        return per_layer, memory_breakdown(s.model, s.cluster, s.plan(), s.training).activations

    (plain, plain_total), (rep, rep_total) = act(False), act(True)
    d, tokens, tp = 128, 8192, 2
    extra = tokens * 2 * 2 * (32 * d - 8 * d) / tp  # K and V, 2 bytes, the repeated heads
    if recompute in ("full", "op"):
        assert rep == plain
        assert rep_total - plain_total == pytest.approx(extra)  # the layer being recomputed
    else:
        assert rep - plain == pytest.approx(extra)
        assert rep_total - plain_total == pytest.approx(32 * extra)  # every layer keeps them


def test_recomputed_layer_is_not_counted_twice() -> None:
    """The layer under recomputation adds what it did not keep, not its kept tensors again."""
    for recompute in ("full", "op"):
        s = spec(tp=1, recompute=recompute, mbs=1, dropout=0.0, attention="flash")
        kept = activation_bytes_per_layer(s.model, s.plan(), s.training)
        full_set = activation_bytes_per_layer(s.model, s.plan(), s.training, recompute="none")
        total = memory_breakdown(s.model, s.cluster, s.plan(), s.training).activations
        assert total == pytest.approx(24 * kept + full_set - kept)


def test_fp8_linears_keep_their_inputs_in_one_byte_with_transformer_engine() -> None:
    """TE saves an FP8 linear's input as its FP8 cast (1 byte); torchao's Float8Linear saves the
    16-bit input, so its layer keeps what a bf16 layer keeps."""

    def per_layer(precision: str, saved: str) -> float:
        training = {"precision": precision, "fp8_saved_inputs": saved}
        s = one_replica("llama3-70b", 4, training, "none", sequence_parallel=True)
        return activation_bytes_per_layer(s.model, s.plan(), s.training)

    bf16, te, torchao = per_layer("bf16", "fp8"), per_layer("fp8", "fp8"), per_layer("fp8", "bf16")
    assert torchao == bf16
    h, hq, ffn, t, tokens = 8192, 8192, 28672, 4, 8192
    # QKV and FFN-in inputs (SP-sharded) and the FFN-out input drop to 1 byte; the projection's
    # FP8 input is kept beside the 16-bit attention output.
    saved = tokens * (2 * h / t + ffn / t - hq / t)
    assert bf16 - te == pytest.approx(saved)


def test_lazy_gradient_points_of_a_small_interleaved_schedule() -> None:
    """p = 2, v = 2, m = 2 by hand (Megatron's interleaved order for rank 0): warm-up is
    2(p - 1) + (v - 1)p = 4 = every forward; the backwards run chunk 1 for micro-batches 0, 1,
    then chunk 0. (held, with gradients, a last-chunk micro-batch held): (4, 0, 1) after the
    forwards, (3, 1, 1) after the first backward, (1, 2, 0) after the third; the others are
    beaten by one of these. The last rank (1F1B) runs each forward's backward at once."""
    from aihpc.perf.step.memory import lazy_grad_points

    assert sorted(lazy_grad_points(2, 2, 2)) == [(1, 2, 0), (3, 1, 1), (4, 0, 1)]
    # 1F1B with m = p: p forwards, then backwards only
    assert sorted(lazy_grad_points(4, 1, 4)) == [(3, 1, 1), (4, 0, 1)]
    # the last rank: forward, backward, forward: one micro-batch with every gradient
    assert lazy_grad_points(4, 1, 4, rank=3) == ((1, 1, 1),)
    # interleaved, the last rank runs (v - 1)p chunks ahead: 9 held with half the gradients
    # and a last-chunk micro-batch in flight, or 7 with all and none
    assert sorted(lazy_grad_points(8, 2, 8, rank=7)) == [(7, 2, 0), (9, 1, 1)]


def test_the_dominance_sweep_keeps_exactly_the_unbeaten_points() -> None:
    """``_dominated`` (one sorted sweep) against the definition, every other point compared, on
    random sets of (held, gradients, logits flag) points."""
    import random

    from aihpc.perf.step.memory import _dominated

    rng = random.Random(7)
    for _ in range(500):
        pts = {(rng.randint(0, 9), rng.randint(0, 5), rng.randint(0, 1)) for _ in range(30)}
        beaten = {
            a
            for a in pts
            if any(b != a and all(x >= y for x, y in zip(b, a, strict=True)) for b in pts)
        }
        assert _dominated(pts) == beaten


@pytest.mark.parametrize(("p", "v", "m"), [(2, 1, 1), (4, 1, 4), (4, 1, 9), (8, 2, 8), (8, 2, 16)])
def test_lazy_gradient_points_hold_at_most_the_in_flight_chunks(p, v, m) -> None:
    """The most chunks held is the schedule's in-flight count: min(p, m) micro-batches under
    1F1B, p v + p - 1 chunks (at most all m v) interleaved. With enough micro-batches for a
    forward after every chunk's first backward, that count and every gradient coexist."""
    from aihpc.perf.step.memory import lazy_grad_points

    points = lazy_grad_points(p, v, m)
    in_flight = min(p, m) if v == 1 else min(m * v, p * v + p - 1)
    assert max(h for h, _, _ in points) == in_flight
    steady = m * v - min(p - 1 if v == 1 else 2 * (p - 1) + (v - 1) * p, m * v)
    if steady >= (v - 1) * p + 2:  # a forward follows chunk 0's first backward
        assert (in_flight, v) in {(h, g) for h, g, _ in points}
    else:
        assert (in_flight, v) not in {(h, g) for h, g, _ in points}


def test_fsdp_under_pp_peaks_before_all_gradients_exist() -> None:
    """FSDP2 under PP (zero 3) creates a chunk's unsharded fp32 gradient at its first backward,
    while backwards free activations. With m = p the first stage never holds both peaks: its
    memory is below the sum by at least one micro-batch's activations, and interleaving (half
    the gradients appear with most activations, the rest after half are freed) lowers it more.
    Megatron's distributed optimizer (zero 1) allocates its gradient buffer up front: no change.
    """
    from dataclasses import replace

    from aihpc.perf.step.memory import DTYPE_BYTES, _layer_params_local

    base = spec(tp=8, pp=4, mbs=1, gbs=8, dp=2, zero=3, recompute="full")
    plan = base.plan()
    assert plan.num_microbatches == 4
    mb = memory_breakdown(base.model, base.cluster, plan, base.training)
    more = replace(plan, global_batch_size=16)  # m = 8 > p: steady state holds both
    full = memory_breakdown(base.model, base.cluster, more, base.training)
    one_mb = activation_bytes_per_layer(base.model, plan, base.training) * 6  # 24 / 4 layers
    assert full.activations - mb.activations == pytest.approx(one_mb, rel=1e-9)
    assert full.gradients == pytest.approx(mb.gradients, rel=1e-9)
    inter = memory_breakdown(base.model, base.cluster, replace(plan, vpp=2), base.training)
    assert inter.total < mb.total
    # at the interleaved peak half the stage's unsharded gradients exist, or all of them
    unsharded = DTYPE_BYTES["fp32"] * (_layer_params_local(base.model, plan, 6) + 51200 * 6144 / 8)
    assert full.gradients - inter.gradients in (
        pytest.approx(0.0, abs=1.0),
        pytest.approx(unsharded / 2, rel=1e-9),
    )
    z1 = spec(tp=8, pp=4, mbs=1, gbs=8, dp=2, zero=1, recompute="full")
    z1_more = replace(z1.plan(), global_batch_size=16)
    a = memory_breakdown(z1.model, z1.cluster, z1.plan(), z1.training)
    b = memory_breakdown(z1.model, z1.cluster, z1_more, z1.training)
    assert a.activations == pytest.approx(b.activations, rel=1e-9)


def test_fsdp_without_pp_has_no_gradients_beside_a_single_micro_batch() -> None:
    """torchtitan's zero_grad frees the sharded gradients before the forward, and the backward
    creates them as it frees activations: with one micro-batch per step they never meet the
    forward's activations. With two, the second forward runs beside the first's gradients.
    DeepSpeed 0.3's ZeRO-3 keeps a preallocated gradient partition: always counted."""
    from dataclasses import replace

    from aihpc.perf.step.memory import DTYPE_BYTES, _layer_params_local

    one = spec(tp=1, mbs=1, dp=8, zero=3, gbs=8)
    two = spec(tp=1, mbs=1, dp=8, zero=3, gbs=16)
    a = memory_breakdown(one.model, one.cluster, one.plan(), one.training)
    b = memory_breakdown(two.model, two.cluster, two.plan(), two.training)
    layer_grad = DTYPE_BYTES["fp32"] * _layer_params_local(one.model, one.plan(), 1)
    shards = b.gradients - layer_grad
    assert a.gradients == pytest.approx(layer_grad, rel=1e-9)
    assert shards == pytest.approx(
        DTYPE_BYTES["fp32"]
        * (_layer_params_local(one.model, one.plan(), 24) + 2 * 51200 * 6144)
        / 8,
        rel=1e-9,
    )
    assert a.activations == pytest.approx(b.activations, rel=1e-9)
    # what the peak leaves out is reported, not lost: with it the step's gradients are whole
    assert a.gradients + a.gradients_after_peak == pytest.approx(b.gradients, rel=1e-9)
    assert b.gradients_after_peak == 0.0
    ds = replace(one.training, zero3_gather="per_tensor")
    c = memory_breakdown(one.model, one.cluster, one.plan(), ds)
    d = memory_breakdown(two.model, two.cluster, two.plan(), ds)
    assert c.gradients == pytest.approx(d.gradients, rel=1e-9) and c.gradients > a.gradients
    # with full recompute the kept activations are small: the end of the backward, all shards
    # made and activations gone but the recompute's working set, is the higher point
    full = spec(tp=1, mbs=1, dp=8, zero=3, gbs=8, recompute="full")
    e = memory_breakdown(full.model, full.cluster, full.plan(), full.training)
    assert e.gradients == pytest.approx(b.gradients, rel=1e-9)
    working = activation_bytes_per_layer(full.model, full.plan(), full.training, recompute="none")
    working -= activation_bytes_per_layer(full.model, full.plan(), full.training)
    assert e.activations == pytest.approx(working, rel=1e-9)
    assert e.logits == 0.0  # the loss's buffers went with the backward that used them


@pytest.mark.parametrize("last_rank", [False, True])
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("v", [1, 2, 4])
@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_lazy_gradient_walk_may_stop_early(p: int, v: int, rounds: int, last_rank: bool) -> None:
    """The walk stops once every chunk has gradients and a forward follows; every point of the
    whole step's walk (written out here without the stop) must still be covered by a returned
    point that is at least as high in both activations and gradients."""
    from aihpc.perf.step.memory import lazy_grad_points

    m, rank = p * rounds, p - 1 if last_rank else 0
    total = m * v
    warm = min(p - 1 - rank if v == 1 else 2 * (p - 1 - rank) + (v - 1) * p, total)
    ops = ["F"] * warm + ["F", "B"] * (total - warm) + ["B"] * warm
    held, last, seen, forwards, backwards, walk = 0, 0, set(), 0, 0, []
    for op in ops:
        if op == "F":
            last += (forwards // p) % v == v - 1
            forwards += 1
            held += 1
            walk.append((held, len(seen), min(last, 1)))
        else:
            walk.append((held, len(seen), min(last, 1)))
            chunk = v - 1 - (backwards // p) % v
            seen.add(chunk)
            last -= chunk == v - 1
            backwards += 1
            held -= 1
            walk.append((held, len(seen), min(last, 1)))
    assert held == 0 and last == 0 and len(seen) == v  # every forward has its backward
    points = lazy_grad_points(p, v, m, rank)
    for a in walk:
        assert any(all(x >= y for x, y in zip(b, a, strict=True)) for b in points), (a, points)


def test_interleaved_last_stage_holds_its_warm_up_chunks() -> None:
    """Megatron-LM's last pipeline rank still warms up (v - 1)p model chunks under interleaving
    (num_warmup_microbatches), so it holds (v - 1)p + 1 chunks of L/(pv) layers, not one
    micro-batch as under 1F1B. A large vocabulary makes the last stage the most loaded."""
    from dataclasses import replace

    base = spec(tp=8, pp=4, mbs=1, gbs=16, zero=1)
    big = replace(base.model, vocab_size=4_096_000)
    plan = replace(base.plan(), vpp=2)
    inter = memory_breakdown(big, base.cluster, plan, base.training)
    plain = memory_breakdown(big, base.cluster, base.plan(), base.training)
    assert inter.stage == plain.stage == "last"
    per_layer = activation_bytes_per_layer(big, plan, base.training)
    assert plain.activations == pytest.approx(per_layer * 6, rel=1e-9)  # 24 / 4 layers, one mb
    assert inter.activations == pytest.approx(per_layer * 6 * (1 * 4 + 1) / 2, rel=1e-9)


def test_lazy_gradient_walk_does_not_list_a_huge_step() -> None:
    """A global batch of 2**63 - 1 sequences is bad input for a trainer but a valid question
    for the estimate: the walk must stop early instead of building the step's op list (it
    once ran the machine out of memory)."""
    from aihpc.perf.step.memory import lazy_grad_points

    huge = 2**62
    assert lazy_grad_points(8, 2, huge) == ((23, 2, 1),)
    assert lazy_grad_points(8, 1, huge, rank=7) == ((1, 1, 1),)
    assert lazy_grad_points(1, 1, huge) == ((1, 1, 1),)
