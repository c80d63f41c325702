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


def test_watchdog_offers_a_stall_once_then_tears_down(tmp_path):
    stalls, hangs = [], []
    wd = Watchdog(
        tmp_path,
        0,
        timeout_s=0.3,
        poll_s=0.05,
        exit_on_hang=False,
        on_hang=hangs.append,
        on_stall=lambda ev: stalls.append(ev) or True,
    ).start()
    try:
        wd.beat(1)
        deadline = time.time() + 5
        while not hangs and time.time() < deadline:
            time.sleep(0.05)
    finally:
        wd.stop()
    assert len(stalls) == 1 and stalls[0]["phase"] == "step"
    # the second finding, in the restart phase the first one opened, is the watchdog's own
    assert len(hangs) == 1 and hangs[0]["phase"] == "restart"


def test_a_beat_rearms_in_process_recovery(tmp_path):
    stalls = []
    wd = Watchdog(
        tmp_path, 0, timeout_s=0.2, poll_s=0.02, exit_on_hang=False,
        on_stall=lambda ev: stalls.append(ev) or True,
    ).start()  # fmt: skip
    try:
        wd.beat(1)
        time.sleep(0.35)
        wd.beat(2)  # the restart worked: a new stall is offered again
        time.sleep(0.35)
    finally:
        wd.stop()
    assert [s["step"] for s in stalls] == [1, 2]


def test_interrupter_breaks_a_blocking_wait_only_while_armed():
    gate = Interrupter()
    assert not gate.interrupt("not training")  # disarmed: nothing sent
    threading.Timer(0.2, gate.interrupt, args=("stalled",)).start()
    start = time.time()
    with pytest.raises(RestartRequested, match="stalled"), gate.armed(0):
        threading.Event().wait(10)  # the injected stall's wait
    assert time.time() - start < 5


def test_node_loss_drill_parses_for_kill_only():
    assert parse_fault("kill:step=5:rank=1:mode=node").mode == "node"
    with pytest.raises(SpecError, match="--inject"):
        parse_fault("exception:step=5:mode=node")
