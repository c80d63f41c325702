"""Built-in fault injection for tests and drills: ``kind[:step=N][:rank=R][:at=WHERE][:...]``.

Kinds: ``kill`` (SIGKILL itself; ``mode=node``: first drop this rank's in-memory checkpoint
copy, as if its node were lost with it, so a restart must take the replica its peer holds),
``hang`` (``mode=stop``, the default: SIGSTOP itself, a rank
that stops answering; ``mode=stall``: the calling thread blocks forever while the process lives
on, as in a storage call that never returns), ``exception`` (raise), ``corrupt-checkpoint``
(flip a byte in, or ``mode=truncate``, a shard of the checkpoint committed at that step).

Where (``at``):

- ``step`` (default): after step N and its checkpoint;
- ``save``: between step N's checkpoint writes and its commit, the window a crash must not tear;
- ``start``: during start-up, before the checkpoint load (``step`` not needed);
- ``load``: as the checkpoint load begins (``step`` not needed);
- ``final``: after the last step, before the final commit and state hash (``step`` not needed);
- ``fs`` with ``op=K`` (``kill`` only): just before the K-th file-system operation under the
  checkpoint folder counted from the start of step N's save (writes, commit, retention, and
  later saves' operations), for crash drills at every operation.

Each fault fires once per run directory: a marker file is written before it fires, so a job
restarted under ``--max-restarts`` replays the step without dying again.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aihpc.resilience.fsops import watch_fs_ops
from aihpc.runspec import SpecError

__all__ = [
    "KINDS",
    "PLACES",
    "Fault",
    "FaultInjector",
    "InjectedFault",
    "corrupt_file",
    "parse_fault",
]

KINDS = ("kill", "hang", "exception", "corrupt-checkpoint")
PLACES = ("step", "save", "start", "load", "final", "fs")
_STEPLESS = ("start", "load", "final")
_ALLOWED = (
    "kind:step=N[:rank=R][:at=step|save|start|load|final|fs][:op=K]"
    "[:mode=flip|truncate|stop|stall|node] with kind one of "
    + ", ".join(KINDS)
    + " (step not needed for at=start|load|final)"
)


class InjectedFault(RuntimeError):
    """Raised by an ``exception`` fault."""


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int = 0
    at: str = "step"
    mode: str = "flip"  # corrupt-checkpoint: flip | truncate; hang: stop | stall
    op: int = 0  # at=fs: the operation to die before (1 = the first)

    @property
    def tag(self) -> str:
        op = f"-op{self.op}" if self.at == "fs" else ""
        return f"{self.kind}-step{self.step}-rank{self.rank}-{self.at}{op}"


def _fields(text: str, parts: list[str]) -> dict[str, str]:
    fields: dict[str, str] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or key not in ("step", "rank", "at", "mode", "op") or key in fields:
            raise SpecError("--inject", text, _ALLOWED)
        fields[key] = value
    return fields


def parse_fault(text: str) -> Fault:
    """``kill:step=17:rank=1`` → Fault; bad input raises SpecError naming what is allowed."""
    kind, *parts = text.strip().split(":")
    if kind not in KINDS:
        raise SpecError("--inject", text, _ALLOWED)
    fields = _fields(text, parts)
    at = fields.get("at", "step")
    default_mode = "stop" if kind == "hang" else "flip"
    mode = fields.get("mode", default_mode)
    try:
        step = int(fields.get("step", "0" if at in _STEPLESS else ""))
        rank = int(fields.get("rank", "0"))
        op = int(fields.get("op", "0"))
    except ValueError:
        raise SpecError("--inject", text, _ALLOWED) from None
    modes = {
        "hang": ("stop", "stall"),
        "corrupt-checkpoint": ("flip", "truncate"),
        "kill": ("flip", "node"),
    }
    if (
        at not in PLACES
        or rank < 0
        or (step < 1 and at not in _STEPLESS)
        or mode not in modes.get(kind, (default_mode,))
        or (at == "fs") != ("op" in fields)
    ):
        raise SpecError("--inject", text, _ALLOWED)
    if kind == "corrupt-checkpoint" and at != "step":
        raise SpecError(
            "--inject", text, "corrupt-checkpoint acts on a committed checkpoint; use at=step"
        )
    if at == "fs" and (kind != "kill" or op < 1):
        raise SpecError("--inject", text, "at=fs takes kill with op=K, K >= 1")
    return Fault(kind, step, rank, at, mode, op)


def corrupt_file(path: Path, mode: str = "flip") -> None:
    """Flip one byte in the middle of ``path``, or cut it to half its size."""
    size = path.stat().st_size
    if mode == "truncate":
        os.truncate(path, size // 2)
        return
    with open(path, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


class FaultInjector:
    """Fires the faults meant for this rank at their step, each once per run directory."""

    def __init__(self, faults: list[Fault], rank: int, run_dir: Path):
        self.faults = [f for f in faults if f.rank == rank]
        self.rank = rank
        self.marker_dir = Path(run_dir) / "faults"
        self.lose_node_memory: Callable[[], None] | None = None  # kill:mode=node

    def due(self, step: int, at: str, kinds: tuple[str, ...] = KINDS) -> list[Fault]:
        return [
            f
            for f in self.faults
            if (f.step == step or at in _STEPLESS)
            and f.at == at
            and f.kind in kinds
            and not (self.marker_dir / f.tag).exists()
        ]

    def _mark(self, fault: Fault, **info: object) -> None:
        # Written and synced before firing: the restarted job must see that it already fired.
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        marker = self.marker_dir / fault.tag
        record = {"fault": fault.tag, "time_unix": time.time(), "pid": os.getpid(), **info}
        with open(marker, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())

    def fire(self, step: int, at: str = "step") -> None:
        """Fire process faults (kill / hang / exception) due at this point."""
        for fault in self.due(step, at, ("kill", "hang", "exception")):
            self._mark(fault)
            where = f"after step {step}" if at == "step" else f"at {at}"
            if at == "save":
                where += f" of step {step}"
            if fault.kind == "kill" and fault.mode == "node" and self.lose_node_memory:
                self.lose_node_memory()
            _act(fault, f"{where} on rank {self.rank}")

    def arm_fs(self, step: int, checkpoint_root: Path) -> None:
        """Step ``step``'s save begins: arm the ``at=fs`` faults due at it."""
        for fault in self.due(step, "fs", ("kill",)):

            def on_op(index: int, what: str, fault: Fault = fault) -> None:
                if index == fault.op:
                    self._mark(fault, op=what)
                    _act(fault, what)

            watch_fs_ops(checkpoint_root, on_op)

    def corrupt(self, step: int, checkpoint_dir: Path) -> Path | None:
        """Damage one shard of the committed checkpoint ``checkpoint_dir``; the file, or None."""
        for fault in self.due(step, "step", ("corrupt-checkpoint",)):
            # Rank 0 commits; another rank's save may return first, so wait for the commit.
            deadline = time.time() + 120
            while not (checkpoint_dir / "MANIFEST.json").exists() and time.time() < deadline:
                time.sleep(0.05)
            shards = sorted(checkpoint_dir.glob("*.distcp"))
            if not shards:
                return None
            self._mark(fault)
            target = shards[min(self.rank, len(shards) - 1)]
            corrupt_file(target, fault.mode)
            return target
        return None


def _act(fault: Fault, where: str) -> None:
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == "hang" and fault.mode == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault.kind == "hang":
        threading.Event().wait()  # this thread never returns; the process lives on
    else:
        raise InjectedFault(f"injected exception {where}")
