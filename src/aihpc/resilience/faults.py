"""Built-in fault injection for tests and drills: ``kind:step=N[:rank=R][:key=value]``.

Kinds: ``kill`` (SIGKILL itself), ``hang`` (SIGSTOP itself: a rank that stops answering),
``exception`` (raise), ``corrupt-checkpoint`` (flip a byte in, or ``mode=truncate``, a shard of
the checkpoint committed at that step). ``at=save`` fires between a checkpoint's writes and its
commit (only with ``kill``/``hang``/``exception``), the window a crash must not tear.
Each fault fires once per run directory: a marker file is written before it fires, so a job
restarted under ``--max-restarts`` replays the step without dying again.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from aihpc.spec import SpecError

__all__ = ["KINDS", "Fault", "FaultInjector", "InjectedFault", "corrupt_file", "parse_fault"]

KINDS = ("kill", "hang", "exception", "corrupt-checkpoint")
_ALLOWED = "kind:step=N[:rank=R][:at=step|save][:mode=flip|truncate] with kind one of " + ", ".join(
    KINDS
)


class InjectedFault(RuntimeError):
    """Raised by an ``exception`` fault."""


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int = 0
    at: str = "step"  # step: after the step (and its checkpoint); save: before the commit
    mode: str = "flip"  # corrupt-checkpoint: flip a byte or truncate the file

    @property
    def tag(self) -> str:
        return f"{self.kind}-step{self.step}-rank{self.rank}-{self.at}"


def parse_fault(text: str) -> Fault:
    """``kill:step=17:rank=1`` → Fault; bad input raises SpecError naming what is allowed."""
    kind, *parts = text.strip().split(":")
    if kind not in KINDS:
        raise SpecError("--inject", text, _ALLOWED)
    fields: dict[str, str] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or key not in ("step", "rank", "at", "mode") or key in fields:
            raise SpecError("--inject", text, _ALLOWED)
        fields[key] = value
    try:
        step = int(fields["step"])
        rank = int(fields.get("rank", "0"))
    except (KeyError, ValueError):
        raise SpecError("--inject", text, _ALLOWED) from None
    at, mode = fields.get("at", "step"), fields.get("mode", "flip")
    if step < 1 or rank < 0 or at not in ("step", "save") or mode not in ("flip", "truncate"):
        raise SpecError("--inject", text, _ALLOWED)
    if kind == "corrupt-checkpoint" and at == "save":
        raise SpecError(
            "--inject", text, "corrupt-checkpoint acts on a committed checkpoint; use at=step"
        )
    return Fault(kind, step, rank, at, mode)


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

    def due(self, step: int, at: str, kinds: tuple[str, ...] = KINDS) -> list[Fault]:
        return [
            f
            for f in self.faults
            if f.step == step
            and f.at == at
            and f.kind in kinds
            and not (self.marker_dir / f.tag).exists()
        ]

    def _mark(self, fault: Fault) -> None:
        # Written and synced before firing: the restarted job must see that it already fired.
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        marker = self.marker_dir / fault.tag
        with open(marker, "w") as f:
            json.dump({"fault": fault.tag, "time_unix": time.time(), "pid": os.getpid()}, f)
            f.flush()
            os.fsync(f.fileno())

    def fire(self, step: int, at: str = "step") -> None:
        """Fire process faults (kill / hang / exception) due at this point."""
        for fault in self.due(step, at, ("kill", "hang", "exception")):
            self._mark(fault)
            if fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind == "hang":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                raise InjectedFault(f"injected exception at step {step} on rank {self.rank}")

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
