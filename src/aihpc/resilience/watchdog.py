"""Heartbeat watchdog: detect a rank that stopped making progress and tear the job down.

The training loop calls ``beat(step)``; a daemon thread writes the last beat time to
``DIR/heartbeat/rank-R.json`` every ``poll_s`` and checks the age of the last beat. When it
exceeds ``timeout_s`` (``startup_timeout_s`` until the first beat after start or resume):

1. it SIGKILLs local peers of the same attempt whose heartbeat is stale too (a SIGSTOPped rank
   cannot act; torchrun would wait up to 30 s after SIGTERM before killing it);
2. it exits the process with ``HANG_EXIT_CODE``, so the elastic agent restarts the job.

A rank stopped with SIGSTOP is caught by its peers: they block in the next collective, their
own beats go stale, and their watchdogs fire. Detection latency is at most timeout_s + poll_s.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["HANG_EXIT_CODE", "Watchdog"]

log = logging.getLogger("aihpc.resilience")

HANG_EXIT_CODE = 75


class Watchdog:
    def __init__(
        self,
        run_dir: str | Path,
        rank: int,
        timeout_s: float,
        *,
        startup_timeout_s: float | None = None,
        poll_s: float | None = None,
        attempt: int = 0,
        on_hang: Callable[[dict], None] | None = None,
        exit_on_hang: bool = True,
    ) -> None:
        self.dir = Path(run_dir) / "heartbeat"
        self.rank = rank
        self.timeout_s = timeout_s
        self.startup_timeout_s = max(timeout_s, startup_timeout_s or timeout_s)
        self.poll_s = poll_s if poll_s is not None else min(1.0, timeout_s / 10)
        self.attempt = attempt
        self.on_hang = on_hang
        self.exit_on_hang = exit_on_hang
        self.host = socket.gethostname()
        self._last_beat = time.time()
        self._step = -1
        self._started_phase = True  # until the first beat: startup bound
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="aihpc-watchdog", daemon=True)
        self.fired: dict | None = None

    def start(self) -> Watchdog:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._write()
        self._thread.start()
        return self

    def beat(self, step: int) -> None:
        """Called by the training loop after each unit of progress (cheap: two stores)."""
        self._last_beat = time.time()
        self._step = step
        self._started_phase = False

    def expect_slow(self) -> None:
        """The next interval may be long (e.g. a restart-time load): use the startup bound."""
        self._last_beat = time.time()
        self._started_phase = True

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _path(self, rank: int) -> Path:
        return self.dir / f"rank-{rank}.json"

    def _write(self) -> None:
        data = {
            "rank": self.rank,
            "pid": os.getpid(),
            "host": self.host,
            "attempt": self.attempt,
            "last_beat_unix": self._last_beat,
            "step": self._step,
        }
        tmp = self._path(self.rank).with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self._path(self.rank))

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._write()
            bound = self.startup_timeout_s if self._started_phase else self.timeout_s
            age = time.time() - self._last_beat
            if age > bound:
                self._fire(age, bound)
                return

    def _fire(self, age: float, bound: float) -> None:
        event = {
            "event": "hang_detected",
            "rank": self.rank,
            "step": self._step,
            "stalled_s": round(age, 3),
            "bound_s": bound,
            "time_unix": time.time(),
            "killed_peers": self._kill_stale_peers(),
        }
        self.fired = event
        log.error(
            "watchdog: rank %d made no progress for %.1f s after step %d (bound %.1f s); "
            "tearing the job down",
            self.rank,
            age,
            self._step,
            bound,
        )
        if self.on_hang is not None:
            try:
                self.on_hang(event)
            except Exception:  # the teardown below must happen regardless
                log.exception("watchdog on_hang callback failed")
        if self.exit_on_hang:
            os._exit(HANG_EXIT_CODE)

    def _kill_stale_peers(self) -> list[int]:
        killed = []
        now = time.time()
        for path in self.dir.glob("rank-*.json"):
            try:
                peer = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if (
                peer.get("rank") == self.rank
                or peer.get("host") != self.host
                or peer.get("attempt") != self.attempt
            ):
                continue
            if now - peer.get("last_beat_unix", now) > self.timeout_s:
                try:
                    os.kill(int(peer["pid"]), signal.SIGKILL)
                    killed.append(int(peer["rank"]))
                except (ProcessLookupError, PermissionError):
                    pass
        return killed
