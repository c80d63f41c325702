"""In-process restart: recover from an exception or a hang in one rank without new processes.

What the anchor (NVIDIA Resiliency Extension, ``nvidia_resiliency_ext.inprocess``) does and we
follow in our own way: the training function is re-run in the same processes; a fault in one
rank makes every rank abandon the step, tear down the process groups, re-form them over the
same store under a new prefix, rebuild the model and restore from memory. Process start-up,
``import torch`` and the agent's rendezvous -- most of an agent restart (benchmarks/results/
recovery_time.md) -- are not paid again.

How the other ranks learn of the fault, on gloo. ``ProcessGroupGloo.abort()`` and
``shutdown()`` leave the pairs' sockets open (measured, torch 2.13), and dropping every Python
reference to a trainer's groups did not close them either (something in the parallelised model
keeps them), so a peer blocked in a collective would wait for the collective timeout. A rank
that enters a restart therefore shuts down its connected TCP sockets except the store's
(``shutdown_collective_sockets``): its peers' pending collectives fail at once with
"Connection closed by peer", they restart too and do the same, so the fault spreads along the
groups in one hop each. The file descriptors stay with gloo (shut down, not closed), so no
descriptor is reused under it. With NCCL, ``abort`` is the tool (not done here: CPU only).

A hang is found by the heartbeat watchdog: it interrupts this rank's main thread
(``Interrupter``: a signal, whose handler raises ``RestartRequested`` while training
runs), which turns the hang into the
exception case. A rank that cannot run Python any more (SIGSTOP, a kernel hang) or a second
stall before the next step escalates to the watchdog's exit, and the elastic agent restarts.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = [
    "Interrupter",
    "RestartRequested",
    "release",
    "restartable",
    "shutdown_collective_sockets",
]


class RestartRequested(RuntimeError):
    """Raised in the main thread when the watchdog found this rank without progress."""


class Interrupter:
    """Turns a watchdog finding into an exception in the main thread, only while ``armed``."""

    SIGNAL = signal.SIGUSR2

    def __init__(self) -> None:
        self._armed = False
        self._generation = 0  # the generation now running
        self._target = -1  # the generation the last interrupt was meant for
        self._main = threading.main_thread().ident
        self.reason = ""
        signal.signal(self.SIGNAL, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        # A signal is handled when the main thread next runs Python, which may be after its
        # generation already failed on its own (a collective error): then it is stale.
        if self._armed and self._target == self._generation:
            self._armed = False
            raise RestartRequested(self.reason or "watchdog: no progress")

    @contextmanager
    def armed(self, generation: int) -> Iterator[None]:
        self._generation, self._armed = generation, True
        try:
            yield
        finally:
            self._armed = False

    def interrupt(self, reason: str) -> bool:
        """From the watchdog thread: break the main thread out of a wait (a blocking call returns
        EINTR and the handler raises). False when training is not running."""
        if not self._armed or self._main is None:
            return False
        self.reason, self._target = reason, self._generation
        signal.pthread_kill(self._main, self.SIGNAL)
        return True


def restartable(err: BaseException) -> bool:
    """In-process restart is for faults of the moment, not for errors a rerun repeats (a bad
    spec, a corrupt checkpoint): pre-training's and the RL loop's rule."""
    from aihpc.resilience.manifest import CheckpointCorruptError
    from aihpc.runspec import SpecError

    return isinstance(err, Exception) and not isinstance(err, SpecError | CheckpointCorruptError)


def release(err: BaseException) -> None:
    """Drop what ``err`` keeps alive (the frames of the failed generation: its model, process
    groups, meshes), so their gloo sockets close now and the peers stop waiting."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    gc.collect()


def shutdown_collective_sockets(keep_ports: set[int]) -> int:
    """Shut down (not close) this process's connected TCP sockets, except those with a local or
    remote port in ``keep_ports`` (the store's); how many. Linux (/proc/self/fd)."""
    done = 0
    try:
        fds = [int(x) for x in os.listdir("/proc/self/fd")]
    except OSError:
        return 0
    for fd in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with contextlib.closing(s):
            try:
                if (
                    s.family not in (socket.AF_INET, socket.AF_INET6)
                    or s.type != socket.SOCK_STREAM
                ):
                    continue
                local, remote = s.getsockname()[1], s.getpeername()[1]
            except OSError:  # listening or unconnected
                continue
            if local in keep_ports or remote in keep_ports:
                continue
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
                done += 1
    return done
