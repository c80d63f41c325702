"""The pieces of in-process restart that need no process group: the watchdog offers a stall
to in-process recovery once per beat, then tears down; the interrupter breaks the main thread
out of a blocking wait; the node-loss drill parses."""

from __future__ import annotations

import threading
import time

import pytest

from aihpc.resilience import Watchdog, parse_fault
from aihpc.resilience.inprocess import Interrupter, RestartRequested
from aihpc.runspec import SpecError
from watchdog_clock import WAIT_S, WatchdogClock


def test_watchdog_offers_a_stall_once_then_tears_down(tmp_path, monkeypatch):
    clock = WatchdogClock(monkeypatch)  # tests/watchdog_clock.py: ages set by the test
    stalls, hangs, done = [], [], threading.Event()
    wd = Watchdog(
        tmp_path,
        0,
        timeout_s=0.3,
        poll_s=0.01,
        exit_on_hang=False,
        on_hang=lambda ev: (hangs.append(ev), done.set()),
        on_stall=lambda ev: stalls.append(ev) or True,
    ).start()
    try:
        wd.beat(1)
        clock.advance(0.31)
        clock.checks()  # the stall is offered, and the restart phase's clock starts
        clock.advance(0.31)
        assert done.wait(WAIT_S)
    finally:
        wd.stop()
    assert len(stalls) == 1 and stalls[0]["phase"] == "step"
    # the second finding, in the restart phase the first one opened, is the watchdog's own
    assert len(hangs) == 1 and hangs[0]["phase"] == "restart"


def test_a_beat_rearms_in_process_recovery(tmp_path, monkeypatch):
    """A beat after a restart offers the next stall to in-process recovery again. The test
    moves the clock (a real sleep on a loaded machine could also outlast the restart phase's
    bound, and the watchdog would then tear down instead)."""
    clock = WatchdogClock(monkeypatch)
    stalls = []
    wd = Watchdog(
        tmp_path, 0, timeout_s=0.2, poll_s=0.01, exit_on_hang=False,
        on_stall=lambda ev: stalls.append(ev) or True,
    ).start()  # fmt: skip
    try:
        wd.beat(1)
        clock.advance(0.25)
        clock.checks()
        wd.beat(2)  # the restart worked: a new stall is offered again
        clock.advance(0.25)
        clock.checks()
    finally:
        wd.stop()
    assert [s["step"] for s in stalls] == [1, 2]


def test_interrupter_breaks_a_blocking_wait_only_while_armed():
    gate = Interrupter()
    assert not gate.interrupt("not training")  # disarmed: nothing sent
    threading.Timer(0.2, gate.interrupt, args=("stalled",)).start()
    start = time.monotonic()
    with pytest.raises(RestartRequested, match="stalled"), gate.armed(0):
        threading.Event().wait(WAIT_S)  # the injected stall's wait
    # broken, not ended: a wait that ran its course and raised after would take WAIT_S
    assert time.monotonic() - start < WAIT_S


def test_node_loss_drill_parses_for_kill_only():
    assert parse_fault("kill:step=5:rank=1:mode=node").mode == "node"
    with pytest.raises(SpecError, match="--inject"):
        parse_fault("exception:step=5:mode=node")
