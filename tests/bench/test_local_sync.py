"""The per-call latency `aihpc calibrate --local` measures for collectives issued between
computations (bench/local_sync.py), and how the estimate prices it: per call, so a plan that
issues more collectives per step pays more on a high-latency host."""

from __future__ import annotations

import pytest

from aihpc.bench.local import _threads
from aihpc.bench.local_sync import interleaved_call_latency_us, with_call_latency
from aihpc.perf.estimate import estimate_plan
from aihpc.spec import runspec_from_dict
from aihpc.spec.calibration import calibration_from_dict

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


def test_call_latency_is_a_floor_that_keeps_bandwidth_and_larger_latencies() -> None:
    cal = with_call_latency(_cal(100.0), 150.0)
    for c in COLLECTIVES:
        small, large = cal.comm_fit(c, "scale_up").regimes
        assert (small.latency_us, large.latency_us) == (150.0, 200.0)
        assert small.busbw_GBps == large.busbw_GBps == 1.0 and small.max_bytes == 65536.0
    assert with_call_latency(_cal(100.0), 0.0) == _cal(100.0)
    assert interleaved_call_latency_us(1) == 0.0  # one rank issues no collective


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
