"""The per-call cost `aihpc calibrate --local` measures for collectives issued between
computations (bench/local_sync.py), and how the estimate prices it: per call, so a plan that
issues more collectives per step pays more on a high-latency host; and the attention length
curve it measures (bench/local.py)."""

from __future__ import annotations

import tomllib

import pytest

from aihpc.bench.local import _threads, attention_shape, half_tokens
from aihpc.bench.local_sync import (
    CallCost,
    call_cost_fit,
    interleaved_call_cost,
    with_call_cost,
)
from aihpc.perf.step.attention_kernels import kernel_efficiency
from aihpc.perf.step.estimate import estimate_plan
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec import runspec_from_dict
from aihpc.runspec.calibration import calibration_from_dict, calibration_to_toml
from aihpc.runspec.errors import SpecError

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


def _cal(latency_us: float):
    return calibration_from_dict(
        {
            "comm": [
                {
                    "collective": c,
                    "tier": "scale_up",
                    "regimes": [
                        {"max_bytes": 65536.0, "latency_us": latency_us, "busbw_GBps": 1.0},
                        {"latency_us": 2 * latency_us, "busbw_GBps": 1.0},
                    ],
                }
                for c in COLLECTIVES
            ]
        }
    )


def test_call_cost_is_a_latency_floor_and_a_bandwidth_ceiling() -> None:
    cal = with_call_cost(_cal(100.0), CallCost(150.0, 0.5))
    for c in COLLECTIVES:
        small, large = cal.comm_fit(c, "scale_up").regimes
        assert (small.latency_us, large.latency_us) == (150.0, 200.0)  # 200 stays: larger
        assert small.busbw_GBps == large.busbw_GBps == 0.5 and small.max_bytes == 65536.0
    fast = with_call_cost(_cal(100.0), CallCost(50.0, 9.0))  # neither slower: nothing moves
    assert fast == _cal(100.0)
    assert with_call_cost(_cal(100.0), CallCost(0.0, None)) == _cal(100.0)
    assert interleaved_call_cost(1) == CallCost(0.0, None)  # one rank issues no collective
    # a measured overlap penalty replaces the model's and survives the TOML round trip
    measured = with_call_cost(_cal(100.0), CallCost(0.0, None, 0.8))
    assert measured.overlap_compute_penalty == 0.8 and measured.comm == _cal(100.0).comm
    text = calibration_to_toml(measured)
    assert calibration_from_dict(tomllib.loads(text)) == measured


def test_the_measured_overlap_penalty_prices_hidden_collectives() -> None:
    # FSDP (ZeRO 3) on 2 ranks hides its gathers behind compute; the host's penalty charges
    # that fraction of the hidden time: 0 hides all of it, 1 none, linear in between.
    spec = runspec_from_dict(
        {
            "model": {"preset": "tiny-llama-small"},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 2},
            "parallel": {"zero_stage": 3, "micro_batch_size": 4, "global_batch_size": 8},
        }
    )

    def step(penalty: float | None) -> float:
        cal = with_call_cost(_cal(100.0), CallCost(0.0, None, penalty))
        cluster = spec.cluster.__class__(**{**spec.cluster.__dict__, "calibration": cal})
        return estimate_plan(spec.model, cluster, spec.plan(), spec.training).step_time_s

    none, half, full = step(0.0), step(0.5), step(1.0)
    assert none < half < full and full - half == pytest.approx(half - none, rel=1e-9)
    default = step(None)  # not measured: the model's constant (a GPU measurement)
    pen = DEFAULT_PARAMS.overlap_compute_penalty
    assert default == pytest.approx(none + pen * (full - none), rel=1e-9)
    with pytest.raises(SpecError, match="overlap_compute_penalty"):
        calibration_from_dict({"overlap_compute_penalty": 1.5})


def test_call_cost_fit_is_the_line_through_the_two_sizes() -> None:
    # 2 ranks: whole buffers of 8 KiB and 1 MiB; a call costs 1 ms + bytes x 1/2 / 0.25 GB/s.
    small, large = 2 * 1024 * 4, 2 * 131072 * 4
    line = [1e-3 + b * 0.5 / 0.25e9 for b in (small, large)]
    fit = call_cost_fit(2, line)
    assert fit.latency_us == pytest.approx(1000.0, rel=1e-4)  # four significant digits
    assert fit.busbw_GBps == pytest.approx(0.25, rel=1e-4)
    flat = call_cost_fit(2, [2e-3, 1.5e-3])  # the larger call was not slower: latency only
    assert flat == CallCost(2000.0, None)


def test_a_third_size_gives_the_large_messages_their_own_line() -> None:
    # 2 ranks: 8 KiB, 1 MiB, 8 MiB; 1 ms + bytes / 0.25 GB/s (bus) up to 1 MiB, then the cost
    # grows at 1 GB/s (bus): above the middle size the second line, not the first extended
    sizes = [2 * n * 4 for n in (1024, 131072, 1048576)]
    t_mid = 1e-3 + sizes[1] * 0.5 / 0.25e9
    seconds = [1e-3 + sizes[0] * 0.5 / 0.25e9, t_mid, t_mid + (sizes[2] - sizes[1]) * 0.5 / 1e9]
    fit = call_cost_fit(2, seconds, 0.9)
    assert (fit.latency_us, fit.busbw_GBps) == pytest.approx((1000.0, 0.25), rel=1e-4)
    assert fit.split_bytes == sizes[1] and fit.overlap_penalty == 0.9
    latency, busbw = fit.large
    assert busbw == pytest.approx(1.0, rel=1e-4)
    assert latency * 1e-6 + sizes[1] * 0.5 / (busbw * 1e9) == pytest.approx(t_mid, rel=1e-3)
    # the calibration's one regime becomes two at the split, each under its own line
    cal = with_call_cost(_cal(100.0), fit)
    for c in COLLECTIVES:
        regimes = cal.comm_fit(c, "scale_up").regimes
        assert [r.max_bytes for r in regimes] == [65536.0, sizes[1], float("inf")]
        assert [r.busbw_GBps for r in regimes] == pytest.approx([0.25, 0.25, 1.0], rel=1e-4)
        assert regimes[0].latency_us == pytest.approx(1000.0, rel=1e-4)
        assert regimes[2].latency_us == pytest.approx(latency, rel=1e-9)
    # priced: a 4 MiB call costs what the measured line says, not the small sizes' line
    big = 4 * 2**20
    one = 1e-3 + big * 0.5 / 0.25e9
    two = latency * 1e-6 + big * 0.5 / 1e9
    assert two < one / 2


def test_attention_half_length_from_two_timings() -> None:
    # On the curve rate(s) = R s / (s + h), the two timings give h back; no fall-off gives 0.
    r_long, h, s = 1.0, 40.0, 128
    rate = [r_long * x / (x + h) for x in (s, s // 2)]
    assert half_tokens(rate[0], rate[1], s) == pytest.approx(h, rel=1e-9)
    assert half_tokens(1.0, 1.0, s) == 0.0 and half_tokens(1.0, 1.1, s) == 0.0
    # The curve anchored where it was measured: 1 there, the measured ratio at half the length.
    eff = kernel_efficiency("flash", (0.3, 0.3), (0.3, 0.3), s, s, (h, h))
    half = kernel_efficiency("flash", (0.3, 0.3), (0.3, 0.3), s // 2, s, (h, h))
    assert eff == pytest.approx((0.3, 0.3), rel=1e-12)
    assert half[0] / eff[0] == pytest.approx(rate[1] / rate[0], rel=1e-12)
    # Without the anchor the catalog's 16K reference applies: the GPU curve at 128 tokens.
    assert kernel_efficiency("flash", (0.3, 0.3), (0.3, 0.3), s)[1] < 0.05


def test_attention_is_measured_at_the_models_call_shape() -> None:
    spec = _spec(2)
    b, heads, kv, seq, d = attention_shape(spec.model, 4)
    assert (b, heads, kv, seq) == (4, 8, 4, 128) and heads * d == spec.model.hidden_size


def _spec(layers: int, tp: int = 2, dp: int = 1):
    spec = runspec_from_dict(
        {
            "model": {"preset": "tiny-llama-small", "num_layers": layers},
            "cluster": {"gpu": "h100-sxm", "num_gpus": tp * dp},
            "parallel": {"tp": tp, "micro_batch_size": 4, "global_batch_size": 8},
        }
    )
    return spec


def _tp_comm(latency_us: float, layers: int) -> float:
    spec = _spec(layers)
    cluster = spec.cluster.__class__(**{**spec.cluster.__dict__, "calibration": _cal(latency_us)})
    est = estimate_plan(spec.model, cluster, spec.plan(), spec.training)
    return est.time_s["tp_comm"]


def test_tp_pays_the_latency_once_per_call() -> None:
    # The calibration's latency applies per collective: the extra tensor-parallel time of a
    # higher latency grows linearly with that latency and with the calls (twice the layers).
    base, slow, slower = _tp_comm(10.0, 4), _tp_comm(1010.0, 4), _tp_comm(2010.0, 4)
    base8, slow8 = _tp_comm(10.0, 8), _tp_comm(1010.0, 8)
    assert slow - base > 4 * 4 * 1e-3 * 0.5  # at least 4 calls per layer, mostly exposed
    assert slower - base == pytest.approx(2 * (slow - base), rel=1e-9)
    assert slow8 - base8 == pytest.approx(2 * (slow - base), rel=1e-9)


def test_one_rank_keeps_every_core_several_ranks_one_each(monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert (_threads(1), _threads(2)) == (2, 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what the launcher and the benchmark set
    assert _threads(1) == 1
