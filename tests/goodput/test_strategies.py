"""Recovery strategies priced side by side: physical properties, not stored outputs.

Each test states what must be true of any correct model (a cumulative strategy never loses, a
tier that covers no failure cannot help, more GPUs never raise ETTR) and the exact mixed-recovery
ETTR is checked against the closed form it generalises and against the event simulator.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from pathlib import Path

import pytest

from aihpc.goodput.ettr import GoodputParams, daly_interval_s, ettr
from aihpc.goodput.failures import components
from aihpc.goodput.plot import with_scale
from aihpc.goodput.simulator import simulate
from aihpc.goodput.strategies import (
    STRATEGIES,
    compare_strategies,
    measured_figures,
    mixed_ettr,
    strategy_result,
)
from aihpc.runspec import load_runspec

ROOT = Path(__file__).resolve().parents[2]
SPEC = load_runspec(ROOT / "examples" / "llama3-405b-16k.toml")
SOFTWARE = {"software", "nccl_watchdog"}


def only(spec, kept: set[str]):  # type: ignore[no-untyped-def]
    """``spec`` with every failure component outside ``kept`` set to rate 0."""
    rates = {name: 0.0 for name in components() if name not in kept}
    return replace(spec, reliability=replace(spec.reliability, failure_rates=rates))


@pytest.mark.parametrize("during", [True, False])
def test_one_kind_reduces_to_the_single_recovery_closed_form(during):
    p = GoodputParams(
        mtbf_s=3000.0,
        blocking_s=4.0,
        persist_s=30.0,
        recovery_s=500.0,
        planned_rate_per_s=1e-5,
        planned_cost_s=700.0,
        failures_during_recovery=during,
    )
    for tau in (30.0, 200.0, 2000.0):
        mixed = mixed_ettr(tau, 4.0, 30.0, [(1 / 3000.0, 500.0)], 1e-5, 700.0, during)
        assert mixed == pytest.approx(ettr(p, tau), rel=1e-12)
        # splitting one kind into two with the same R changes nothing
        halves = [(0.5 / 3000.0, 500.0), (0.5 / 3000.0, 500.0)]
        assert mixed_ettr(tau, 4.0, 30.0, halves, 1e-5, 700.0, during) == pytest.approx(mixed)


def test_a_mix_lies_between_its_extremes_and_beats_its_mean():
    """Jensen: with e^{λR} convex, a mix of R is better than every failure costing the mean R."""
    lam = 1 / 2000.0
    mix = [(0.8 * lam, 1000.0), (0.2 * lam, 20.0)]
    mean_r = 0.8 * 1000.0 + 0.2 * 20.0
    got = mixed_ettr(120.0, 1.0, 0.0, mix)
    assert (
        mixed_ettr(120.0, 1.0, 0.0, [(lam, 1000.0)])
        < got
        < mixed_ettr(120.0, 1.0, 0.0, [(lam, 20.0)])
    )
    assert got > mixed_ettr(120.0, 1.0, 0.0, [(lam, mean_r)])


def test_simulator_confirms_the_mixed_ettr_of_in_process_restart_at_100k():
    res = strategy_result(with_scale(SPEC, 100000), "inprocess")
    tau = res.interval_s
    mix = res.recoveries(tau)
    lam = sum(r for r, _ in mix)
    p = GoodputParams(
        mtbf_s=1 / lam,
        blocking_s=res.blocking_s,
        persist_s=res.persist_s,
        recovery_s=math.nan,  # drawn per failure from the mix
        planned_rate_per_s=res.planned_rate_per_s,
        planned_cost_s=res.planned_cost_s,
    )
    sim = simulate(p, tau, num_failures=20_000, seed=3, recovery_mix=mix)
    assert len({round(r) for _, r in mix}) >= 2  # really a mix of recovery times
    assert sim.ettr == pytest.approx(res.ettr, abs=0.01)


def test_simulator_tells_the_mixed_ettr_from_one_at_the_mean_recovery():
    """Half the failures recover in 30 s, half in 50 min, MTBF 30 min: pricing every failure at
    the mean R is 10+ points off; the exact mix agrees with the simulation."""
    lam, mix = 1 / 1800.0, [(0.5 / 1800.0, 30.0), (0.5 / 1800.0, 3000.0)]
    p = GoodputParams(mtbf_s=1 / lam, blocking_s=2.0, persist_s=0.0, recovery_s=math.nan)
    sim = simulate(p, 90.0, num_failures=20_000, seed=5, recovery_mix=mix).ettr
    exact = mixed_ettr(90.0, 2.0, 0.0, mix)
    at_mean = mixed_ettr(90.0, 2.0, 0.0, [(lam, 1515.0)])
    assert abs(exact - at_mean) > 0.1
    assert sim == pytest.approx(exact, abs=0.01)


def test_cumulative_strategies_never_lose_and_etr_falls_with_gpu_count():
    counts = [1024, 4096, 16384, 65536, 100000, 131072]
    table = compare_strategies(SPEC, counts)
    for n in counts:
        e = [table[n][s].ettr for s in STRATEGIES]
        assert e == sorted(e), (n, e)  # sync ≤ async ≤ in_memory ≤ inprocess
    for s in STRATEGIES:
        e = [table[n][s].ettr for n in counts]
        assert all(a > b for a, b in itertools.pairwise(e)), (s, e)


def test_in_process_restart_wins_when_failures_are_software_and_ties_when_none_are():
    soft = compare_strategies(only(SPEC, SOFTWARE), [16384])[16384]
    assert soft["inprocess"].ettr > soft["in_memory"].ettr + 0.002
    assert soft["inprocess"].ettr > soft["sync"].ettr
    hard = compare_strategies(only(SPEC, set(components()) - SOFTWARE), [16384])[16384]
    assert hard["inprocess"].ettr == pytest.approx(hard["in_memory"].ettr, rel=1e-12)


def test_peer_memory_helps_with_slow_storage_unless_every_loss_takes_the_peer_too():
    slow = replace(SPEC, cluster=replace(SPEC.cluster, storage_read_bw_GBps=20.0))
    nodes = only(slow, set(components()) - SOFTWARE)
    indep = compare_strategies(nodes, [16384])[16384]
    assert indep["in_memory"].ettr > indep["async"].ettr + 0.01  # 5.7 TB at 20 GB/s: 4.7 min
    both = compare_strategies(nodes, [16384], correlated_loss_fraction=1.0)[16384]
    assert both["in_memory"].ettr == pytest.approx(both["async"].ettr, abs=1e-3)
    assert both["in_memory"].ettr < indep["in_memory"].ettr


def test_interval_is_optimal_per_strategy_and_follows_its_save_cost():
    row = compare_strategies(SPEC, [16384])[16384]
    for res in row.values():
        tau = res.interval_s
        assert res.ettr >= res.ettr_at(0.8 * tau) and res.ettr >= res.ettr_at(1.25 * tau)
    sync, asy = row["sync"], row["async"]
    assert sync.interval_s > asy.interval_s  # a 3.6 s blocking save is taken less often
    # no persist window and every rollback to the same save: Daly's eq. 37 applies
    assert sync.interval_s == pytest.approx(daly_interval_s(sync.blocking_s, sync.mtbf_s), rel=0.01)


def test_lost_time_parts_sum_to_the_loss():
    for res in compare_strategies(SPEC, [100000])[100000].values():
        lost = res.lost_time()
        assert sum(lost.values()) == pytest.approx(1 - res.ettr)
        assert min(lost.values()) >= 0
    row = compare_strategies(SPEC, [100000])[100000]
    assert row["inprocess"].lost_time()["restart"] < row["in_memory"].lost_time()["restart"]


def test_measured_figures_replace_published_ones_and_say_so():
    legacy = {"median": {"kill": {"detection_s": 0.13, "restart_s": 5.0, "load_s": 0.4}}}
    facts = measured_figures(legacy, "recovery_time.json")
    assert facts["restart.agent_storage"].value == 5.0
    assert (
        facts["restart.agent_storage"].source
        == "measured: recovery_time.json median.kill.restart_s"
    )
    # a relaunch that restores from peer memory relaunches the same way: it follows the measurement
    peer = strategy_result(SPEC, "in_memory", measured=facts).paths["node"].restart
    assert peer.value == 5.0 and "measured" in peer.source
    per_path = {
        "paths": {
            "inprocess_exception": {"detection_s": 0.2, "restart_s": 1.0, "total_s": 1.5},
            "inprocess_hang": {"detection_s": 3.0, "restart_s": 1.0},
        }
    }
    facts = measured_figures(per_path, "r.json")
    assert set(facts) == {
        "detection.exception_inprocess",
        "restart.inprocess_exception",
        "detection.hang_inprocess",
        "restart.inprocess_hang",
    }
    published = strategy_result(SPEC, "inprocess")
    fast = strategy_result(SPEC, "inprocess", measured=facts)
    assert fast.ettr > published.ettr
    assert (
        fast.paths["exception"].restart.source
        == "measured: r.json paths.inprocess_exception.restart_s"
    )
    assert fast.paths["node"].restart.source.startswith("published")  # not measured: untouched
