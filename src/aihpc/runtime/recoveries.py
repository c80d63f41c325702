"""Where a launch resumed from, for its summary: the step and the tier that served each load.

Every load of the state is one of: the launch's own start (a rerun of the command, a Slurm
requeue), an agent restart of the worker group (a new attempt, new processes), or an in-process
restart (a new generation in the same processes). Each is served by a tier: ``memory`` (every
rank's own in-memory copy), ``peer`` (some ranks took the replica a peer kept), ``storage``
(the newest intact checkpoint: also where the memory tier had nothing usable, its copies lost
or never taken over ``memory_max_GiB``), or none (``null``: nothing to resume, step 0).

``summary.json`` gets ``resumed_from`` (the load its training continued from) and
``recoveries`` (every load after a fault in the launch, in order), read back from the
``loaded`` events rank 0 wrote, since an agent restart leaves no process that remembers them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["launch_recoveries", "load_record", "tier"]


def tier(source: str | None, from_peer: Any, step: int) -> str | None:
    """The tier of a load: memory | peer | storage, or None when it started at step 0."""
    if not step:
        return None
    if source == "memory":
        return "peer" if from_peer else "memory"
    return "storage"


def _restart(attempt: int, generation: int) -> str:
    if generation:
        return "in-process"
    return "process" if attempt else "launch"


def load_record(
    step: int, source: str | None, from_peer: Any, attempt: int, generation: int
) -> dict[str, Any]:
    """One load as the summary records it."""
    return {
        "step": step,
        "tier": tier(source, from_peer, step),
        "restart": _restart(attempt, generation),
        "attempt": attempt,
        "generation": generation,
    }


def launch_recoveries(events_path: Path) -> list[dict[str, Any]]:
    """Rank 0's loads after a fault in the current launch (its agent restarts and in-process
    restarts), in order, from ``events.jsonl``. Lines that do not parse, or whose fields are
    not what the trainer writes, are passed over: this is a report, not a resume."""
    loads: list[dict[str, Any]] = []
    try:
        text = events_path.read_text(errors="replace")
    except OSError:
        return loads
    for line in text.splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if not isinstance(ev, dict) or ev.get("rank") != 0:
            continue
        attempt, generation = ev.get("attempt", 0), ev.get("generation", 0)
        if not (_is_int(attempt) and _is_int(generation)):
            continue
        if ev.get("event") == "process_start" and attempt == 0 and generation == 0:
            loads = []  # a new launch: the loads before it were an earlier launch's
        elif ev.get("event") == "loaded" and (attempt or generation) and _is_int(ev.get("step")):
            source = ev.get("source") if isinstance(ev.get("source"), str) else None
            loads.append(load_record(ev["step"], source, ev.get("from_peer"), attempt, generation))
    return loads


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
