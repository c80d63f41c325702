"""The watchdog kills only a process it can prove is the peer whose heartbeat went stale: the
heartbeat's PID with that process's start time and the boot, checked through a pidfd. A stale
heartbeat whose PID now names an unrelated live process (here a ``sleep``) leaves it alive,
with one line saying why; the same heartbeat naming the process it describes kills it."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading

import pytest

from aihpc.resilience import Watchdog
from aihpc.resilience.watchdog import boot_id, process_start_ticks
from watchdog_clock import WAIT_S, WatchdogClock

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the start-time proof reads Linux's /proc"
)


@pytest.fixture
def bystander():
    """An unrelated live process: the PID a stale heartbeat may name after PID reuse."""
    proc = subprocess.Popen(["sleep", "600"])
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _fire_with_peer(tmp_path, monkeypatch, peer: dict) -> dict:
    """Rank 0's watchdog finds its hang with rank 1's stale heartbeat ``peer`` beside it; the
    hang event."""
    clock = WatchdogClock(monkeypatch)
    hb = tmp_path / "heartbeat"
    hb.mkdir()
    wd = Watchdog(tmp_path, 0, timeout_s=0.3, poll_s=0.01, exit_on_hang=False)
    beat = {"rank": 1, "host": wd.host, "attempt": 0, "last_beat_unix": clock.now - 100.0}
    (hb / "rank-1.json").write_text(json.dumps({**beat, **peer}))
    hangs, done = [], threading.Event()
    wd.on_hang = lambda ev: (hangs.append(ev), done.set())
    wd.start()
    try:
        clock.advance(10.0)
        assert done.wait(WAIT_S)
    finally:
        wd.stop()
    return hangs[0]


def _spared_line(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "not killing rank 1" in r.getMessage()]


def test_heartbeat_records_what_proves_the_pid(tmp_path):
    wd = Watchdog(tmp_path, 3, timeout_s=5.0).start()
    try:
        beat = json.loads((tmp_path / "heartbeat" / "rank-3.json").read_text())
    finally:
        wd.stop()
    assert beat["pid"] == os.getpid()
    assert beat["start_ticks"] == process_start_ticks(os.getpid()) is not None
    assert beat["boot_id"] == boot_id() is not None


@pytest.mark.parametrize("case", ["bare pid", "another start time", "another boot"])
def test_stale_heartbeat_naming_an_unrelated_process_spares_it(
    tmp_path, monkeypatch, caplog, bystander, case
):
    """The heartbeat's PID now belongs to ``sleep`` (PID reuse): whether the heartbeat has no
    start time (as heartbeats had before), a start time that is not sleep's, or is from another
    boot, the watchdog must not kill it, and says why in one line."""
    start = process_start_ticks(bystander.pid)
    peer = {
        "bare pid": {"pid": bystander.pid},
        "another start time": {
            "pid": bystander.pid,
            "start_ticks": start - 1,
            "boot_id": boot_id(),
        },
        "another boot": {"pid": bystander.pid, "start_ticks": start, "boot_id": "0" * 36},
    }[case]
    caplog.set_level(logging.WARNING, logger="aihpc.resilience")
    event = _fire_with_peer(tmp_path, monkeypatch, peer)
    assert bystander.poll() is None, "the watchdog killed a process that was not its peer"
    assert event["killed_peers"] == []
    assert [s["rank"] for s in event["spared_peers"]] == [1]
    lines = _spared_line(caplog)
    assert len(lines) == 1 and str(bystander.pid) in lines[0] and "\n" not in lines[0]


def test_stale_heartbeat_of_the_process_it_names_kills_it(tmp_path, monkeypatch, bystander):
    """The proof holds for the process the heartbeat describes: it is killed (the hung-worker
    case; the multi-process hang tests run it with real ranks)."""
    peer = {
        "pid": bystander.pid,
        "start_ticks": process_start_ticks(bystander.pid),
        "boot_id": boot_id(),
    }
    event = _fire_with_peer(tmp_path, monkeypatch, peer)
    assert event["killed_peers"] == [1] and event["spared_peers"] == []
    assert bystander.wait(timeout=WAIT_S) == -signal.SIGKILL
