"""Fast recovery of a GRPO run, as pre-training has it (runtime/train.py, resilience/memory.py,
docs/resilience.md): in-memory peer checkpoints of the RL state and in-process restarts.

The state a step leaves behind: the policy and its optimizer (each rank's own shards), the
reference, the step (the data cursor and the RNG: prompts and samples are one function of
(seed, step)), whether the warm-up is done and, disaggregated, the staleness queue (rank 0's
pool: the owed batches, the results that had come, the weights of each version whose batch had
not, so a fresh pool makes the rest again without waiting for them at the snapshot). With
``[checkpoint] memory_interval_steps`` it is snapshotted to this node's memory and a peer's
every that many steps (``MemoryCheckpoint``, the same tier and files as pre-training's).

An exception in a generation (a step, a collective that failed because a peer left, a rollout
pool that gave up) ends it on every rank: the rank shuts its collective sockets so blocked peers
fail at once, its pool's workers are killed, and a new generation starts in the same processes:
new process groups over the same store, the trainer rebuilt, the newest state restored from
memory (own copy or the peer's) or from the newest checkpoint file, whichever is newer, the
metrics and sample lines after it dropped. Up to ``[checkpoint] in_process_restarts`` times per
launch (unset: pre-training's default, on gloo only); a SpecError or a corrupt file is raised.

Hangs: every rank runs pre-training's heartbeat watchdog (resilience/watchdog.py) over the RL
loop's phases (start-up, the warm-up and evaluations, each GRPO step, the final evaluation).
A rank without progress for ``--hang-timeout`` is torn down (exit 75, its stale local peers
killed) or, where ``in_process_restarts`` is set explicitly, interrupted in its main thread and
restarted in-process like an exception (``Hangs``), as pre-training does.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from aihpc.resilience import ModelOptimizerState
from aihpc.runspec import RunSpec
from aihpc.runtime.rl.worker import pack, unpack

__all__ = ["Hangs", "RLState", "generations", "memory_tier", "restore"]

log = logging.getLogger("aihpc.runtime")


class RLState:
    """Stateful: the trainer's state beyond the policy and its optimizer."""

    def __init__(self, trainer: Any) -> None:
        self.tr = trainer

    def state_dict(self) -> dict[str, Any]:
        tr = self.tr
        owner = tr.pool is not None and tr.pool.owner
        return {
            "scalars": {"step": tr.step, "sft_done": tr.sft_done},
            "reference": tr.reference.state_dict(),
            # bytes as a latin-1 string: a weights-only load takes str, not bytes
            "rollout": pack(tr.pool.state(wait=False)).decode("latin-1") if owner else "",
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        tr = self.tr
        tr.step = int(state["scalars"]["step"])
        tr.sft_done = bool(state["scalars"]["sft_done"])
        tr.reference.load_state_dict(state["reference"])
        if tr.pool is not None and state["rollout"]:
            tr.pool.load_state(unpack(state["rollout"].encode("latin-1")), tr.step)


@dataclass(frozen=True)
class Hangs:
    """A hang turned into an in-process restart: the watchdog that finds it, the interrupter that
    raises it in the main thread, the events file both write to, the restart phase's bound."""

    watchdog: Any
    interrupter: Any
    events: Any
    startup_s: float


def rl_state(trainer: Any) -> dict[str, Any]:
    return {"train": ModelOptimizerState(trainer.policy, trainer.optimizer), "rl": RLState(trainer)}


def memory_tier(spec: RunSpec, run_dir: Path, trainer: Any) -> Any:
    """The in-memory peer tier when ``[checkpoint] memory_interval_steps`` is set (collective)."""
    c = spec.checkpoint
    if not c.memory_interval_steps:
        return None
    from aihpc.resilience.memory import MemoryCheckpoint

    identity = {
        "rl": asdict(trainer.g),
        "model": asdict(trainer.cfg),
        "plan": str(trainer.par.dims),
    }
    return MemoryCheckpoint(run_dir, identity, max_bytes=c.memory_max_GiB * 2**30)


def newest_file(ckpt_dir: Path) -> Path | None:
    found = sorted(ckpt_dir.glob("rl_*.pt"))
    return found[-1] if found else None


def restore(trainer: Any, memory: Any, ckpt_dir: Path) -> dict[str, Any]:
    """Load the newest state into ``trainer``: from memory when every rank can and it is not
    older than the newest file (rank 0's view), else from that file. What was loaded from where:
    {"step", "source": memory | storage | None, "from_peer": ranks that took a peer's copy}."""
    newest = [newest_file(ckpt_dir)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(newest, src=0)
    path = newest[0]
    if memory is not None:
        got = memory.restore(rl_state(trainer), int(path.stem[3:]) if path else None)
        if got is not None:
            trainer.sync()  # the rollout model: the restored policy's weights
            return {"step": got["step"], "source": "memory", "from_peer": got["from_peer"]}
    if path is not None:
        trainer.load(path)
        return {"step": trainer.step, "source": "storage", "from_peer": []}
    return {"step": 0, "source": None, "from_peer": []}


def generations(
    run: Callable[[int], dict[str, Any]],
    limit: int,
    hangs: Any = None,
) -> dict[str, Any]:
    """``run(generation)`` until one finishes, at most ``limit`` restarts after restartable
    exceptions; between two, the failed one's sockets shut and its frames released. ``hangs``
    (a ``Hangs``): the watchdog's finding interrupts the generation as an exception does."""
    from aihpc.resilience.inprocess import release, restartable, shutdown_collective_sockets

    generation = 0
    while True:
        try:
            with hangs.interrupter.armed(generation) if hangs else nullcontext():
                return run(generation)
        except Exception as err:
            if generation >= limit or not restartable(err):
                raise
            cause = f"{type(err).__name__}: {err}"[:300]
            if hangs is not None:  # the restart's own clock, as pre-training's
                hangs.watchdog.phase("restart", hangs.startup_s)
                hangs.events("inprocess_restart", generation=generation + 1, cause=cause)
            log.warning("rl train: in-process restart %d after %s", generation + 1, cause)
            shutdown_collective_sockets({int(os.environ.get("MASTER_PORT", "0"))})
            release(err)
            del err
            generation += 1
