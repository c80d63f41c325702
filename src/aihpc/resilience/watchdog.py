"""Heartbeat watchdog: detect a rank that stopped making progress and tear the job down.

A run moves through *phases*, each with its own bound: ``start-up`` (process start, process
group, model build), ``load``, ``first step``, ``step`` (the steady state), ``save`` and
``final`` (the last commit and the state hash). The loop calls ``phase(name, bound_s)`` when it
enters one and ``beat(step)`` after each step, which returns to the ``step`` phase and its
``timeout_s`` bound. A daemon thread writes the last beat to ``DIR/heartbeat/rank-R.json``
every ``poll_s`` and checks the age of the phase clock. When it exceeds the phase's bound:

1. it SIGKILLs local peers of the same attempt whose heartbeat is stale too (a SIGSTOPped rank
   cannot act; torchrun would wait up to 30 s after SIGTERM before killing it), and only a
   process it can prove is that peer: the heartbeat records the PID with the process's start
   time (``/proc/PID/stat`` field 22, clock ticks since boot) and the boot id; the watchdog
   opens a pidfd on the PID, checks the start time again and signals through the pidfd, so a
   PID the kernel gave to another process since is never hit (systemd's PID-reuse-safe
   tracking). A peer it cannot prove is left alone with one line saying why;
2. it exits the process with ``HANG_EXIT_CODE``, so the elastic agent restarts the job.

A rank stopped with SIGSTOP is caught by its peers: they block in the next collective, their
own beats go stale, and their watchdogs fire. Detection latency is at most bound + poll_s.

``on_stall(event) -> bool`` (in-process restart): asked first when the bound is exceeded; if it
returns True (it interrupted the main thread, ``aihpc.resilience.inprocess``) the watchdog
restarts its clock in phase ``restart`` and keeps watching; a second finding before the next
beat tears the job down as above.

``watch_parent=PID``: the process also ends (``ORPHAN_EXIT_CODE``) when its parent is no
longer PID, i.e. the launcher died and the process was re-parented. That is the portable half
of "killing the launcher stops the job"; ``die_with_parent()`` is the instant Linux half.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "HANG_EXIT_CODE",
    "ORPHAN_EXIT_CODE",
    "Watchdog",
    "boot_id",
    "die_with_parent",
    "process_start_ticks",
]

log = logging.getLogger("aihpc.resilience")

HANG_EXIT_CODE = 75
ORPHAN_EXIT_CODE = 76
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(expected_parent: int | None = None) -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``).

    The signal is tied to the parent *thread* that forked us; torchelastic's agent and plain
    torchrun start workers from their main thread, which lives as long as the launcher. If the
    parent is already gone (it died between our fork and this call) we exit at once. Returns
    False where the call is not available (not Linux), leaving the watchdog's check to act.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(ORPHAN_EXIT_CODE)
    return True


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
        watch_parent: int | None = None,
        on_stall: Callable[[dict], bool] | None = None,
    ) -> None:
        self.dir = Path(run_dir) / "heartbeat"
        self.rank = rank
        self.timeout_s = timeout_s
        self.poll_s = poll_s if poll_s is not None else min(1.0, timeout_s / 10)
        self.attempt = attempt
        self.on_hang = on_hang
        self.exit_on_hang = exit_on_hang
        self.watch_parent = watch_parent
        self.on_stall = on_stall
        self._interrupted = False  # on_stall acted since the last beat
        self.host = socket.gethostname()
        self._since = time.time()  # when the current phase started or the last beat came
        self._step = -1
        self._phase = ("start-up", max(timeout_s, startup_timeout_s or timeout_s))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="aihpc-watchdog", daemon=True)
        self.fired: dict | None = None
        # who this process is, beyond its PID: what a peer checks before it signals us
        self._identity = {"start_ticks": process_start_ticks(os.getpid()), "boot_id": boot_id()}

    @property
    def current_phase(self) -> tuple[str, float]:
        """(name, bound in seconds) of the phase the rank is in."""
        return self._phase

    def start(self) -> Watchdog:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._write()
        self._thread.start()
        return self

    def beat(self, step: int) -> None:
        """Called by the training loop after each step (cheap: three stores)."""
        self._since = time.time()
        self._step = step
        self._phase = ("step", self.timeout_s)
        self._interrupted = False

    def phase(self, name: str, bound_s: float) -> None:
        """Enter phase ``name``; the clock restarts and the rank may stay ``bound_s`` in it."""
        self._since = time.time()
        self._phase = (name, max(bound_s, self.timeout_s))

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _path(self, rank: int) -> Path:
        return self.dir / f"rank-{rank}.json"

    def _write(self) -> None:
        name, bound = self._phase
        data = {
            "rank": self.rank,
            "pid": os.getpid(),
            **self._identity,
            "host": self.host,
            "attempt": self.attempt,
            "last_beat_unix": self._since,
            "step": self._step,
            "phase": name,
            "bound_s": bound,
        }
        tmp = self._path(self.rank).with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self._path(self.rank))

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.watch_parent is not None and os.getppid() != self.watch_parent:
                log.error("watchdog: the launcher (PID %d) is gone; exiting", self.watch_parent)
                os._exit(ORPHAN_EXIT_CODE)
            try:
                self._write()
            except OSError as err:  # a full disk must not stop hang detection
                log.warning("watchdog: cannot write heartbeat (%s)", err)
            name, bound = self._phase
            age = time.time() - self._since
            if age > bound:
                if self._stall(name, age, bound):
                    continue
                self._fire(name, age, bound)
                return

    def _stall(self, phase: str, age: float, bound: float) -> bool:
        """Offer the finding to ``on_stall`` once per beat; True if it acted."""
        if self.on_stall is None or self._interrupted:
            return False
        event = {"rank": self.rank, "step": self._step, "phase": phase, "stalled_s": round(age, 3)}
        try:
            acted = self.on_stall(event)
        except Exception:
            log.exception("watchdog on_stall callback failed")
            return False
        if acted:
            self._interrupted = True
            self.phase("restart", self.timeout_s)
        return acted

    def _fire(self, phase: str, age: float, bound: float) -> None:
        event = {
            "event": "hang_detected",
            "rank": self.rank,
            "step": self._step,
            "phase": phase,
            "stalled_s": round(age, 3),
            "bound_s": bound,
            "time_unix": time.time(),
        }
        event["killed_peers"], event["spared_peers"] = self._kill_stale_peers()
        self.fired = event
        log.error(
            "watchdog: rank %d made no progress for %.1f s in phase %s after step %d "
            "(bound %.1f s); tearing the job down",
            self.rank,
            age,
            phase,
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

    def _kill_stale_peers(self) -> tuple[list[int], list[dict]]:
        """SIGKILL local peers of this attempt without a beat for ``timeout_s``: a stopped peer
        and one blocked waiting for it both qualify, and the job is being torn down anyway.
        (killed ranks, [{rank, pid, why}] for the peers left alone: not provably theirs)."""
        killed, spared = [], []
        now = time.time()
        for path in self.dir.glob("rank-*.json"):
            try:
                peer = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if (
                not isinstance(peer, dict)
                or peer.get("rank") == self.rank
                or peer.get("host") != self.host
                or peer.get("attempt") != self.attempt
            ):
                continue
            beat = peer.get("last_beat_unix", now)
            if isinstance(beat, int | float) and now - beat > self.timeout_s:
                why = _kill_if_same(peer)
                if why is None:
                    killed.append(peer.get("rank"))
                    continue
                log.warning(
                    "watchdog: not killing rank %s (PID %s from its stale heartbeat): %s",
                    peer.get("rank"),
                    peer.get("pid"),
                    why,
                )
                spared.append({"rank": peer.get("rank"), "pid": peer.get("pid"), "why": why})
        return killed, spared


def boot_id() -> str | None:
    """This boot's id (Linux); a heartbeat from before a reboot names other processes."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def process_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/PID/stat`` field 22);
    None if there is no such process (or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and ')': the fields after the last ')' are
    # field 3 onwards
    fields = stat[stat.rindex(b")") + 2 :].split()
    try:
        return int(fields[22 - 3])
    except (IndexError, ValueError):
        return None


def _kill_if_same(peer: dict) -> str | None:
    """SIGKILL the process a peer's heartbeat names if it provably still is that process;
    else why not."""
    pid, start = peer.get("pid"), peer.get("start_ticks")
    if type(pid) is not int or pid <= 1 or pid == os.getpid():
        return f"its PID {pid!r} is not a worker's"
    if type(start) is not int:
        return "the heartbeat does not record the process's start time, so the PID proves nothing"
    if peer.get("boot_id") != boot_id():
        return "the heartbeat is from another boot of this host"
    pidfd = None
    try:
        if hasattr(os, "pidfd_open"):  # Linux 5.3+: the fd pins this very process
            try:
                pidfd = os.pidfd_open(pid)
            except ProcessLookupError:
                return "it has exited"
            except OSError:  # ENOSYS (older kernel), EPERM: fall back to the start-time check
                pidfd = None
        now = process_start_ticks(pid)
        if now is None:
            return "it has exited"
        if now != start:
            return (
                f"PID {pid} now belongs to another process (started at tick {now}, "
                f"the rank's at {start})"
            )
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return "it has exited"
    except PermissionError:
        return "not permitted to signal it"
    finally:
        if pidfd is not None:
            os.close(pidfd)
    return None
