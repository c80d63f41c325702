"""A wall clock for the watchdog that moves only when a test moves it.

The watchdog's thread compares the age of its phase clock with the phase's bound every
``poll_s``. A test that beats and sleeps for real fails on a loaded machine: a sleep of 0.1 s
that takes 0.6 s is a real stall. With this clock installed (``aihpc.resilience.watchdog.time``
replaced) the ages the watchdog sees are exactly the ones the test sets, and ``checks(n)`` waits,
on a condition rather than a sleep, until the watchdog's thread has read the clock ``n`` more
times: a check that read the clock after ``advance`` returned has seen the new time. The thread
reads it once per round of its loop (and a few times more when it fires).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

import aihpc.resilience.watchdog as watchdog_module

# Long enough never to end a wait that a working watchdog would end (it polls every few ms in
# these tests); a broken one fails the test here instead of hanging it.
WAIT_S = 60.0


class WatchdogClock:
    def __init__(self, monkeypatch: pytest.MonkeyPatch, start: float = 1024.0) -> None:
        self.now = start
        self._reads = 0
        self._changed = threading.Condition()
        monkeypatch.setattr(watchdog_module, "time", SimpleNamespace(time=self._time))

    def _time(self) -> float:
        with self._changed:
            if threading.current_thread().name == "aihpc-watchdog":
                self._reads += 1
                self._changed.notify_all()
            return self.now

    def advance(self, seconds: float) -> None:
        with self._changed:
            self.now += seconds

    def checks(self, n: int = 3) -> None:
        """Wait until the watchdog's thread has read the clock ``n`` more times: with 3, a round
        that read the new time has ended (a stall offered to ``on_stall`` reads it twice) and
        the next has begun."""
        with self._changed:
            target = self._reads + n
            if not self._changed.wait_for(lambda: self._reads >= target, WAIT_S):
                raise AssertionError(f"the watchdog's thread did not poll within {WAIT_S} s")
