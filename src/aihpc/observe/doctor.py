"""``aihpc doctor``: from a failed or hung job's logs, the first failure, its class, where it
came from, the failures it caused, and what to do.

The rule (the one NVIDIA's LogSage and Meta's Llama 3 team apply by hand): thousands of ranks
print errors after one thing breaks, and nearly all of them are ``follow_on`` (a peer closed the
connection, the watchdog tore the process down) or ``symptom`` (a collective timed out waiting).
The root cause is the earliest ``cause``-tier event (hardware, OOM, crash, exception, the
scheduler); only when there is none is it the earliest symptom, and then the question is which
ranks had not joined: the flight recorder, the watchdog's sequence numbers and the ranks that said
nothing answer it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from aihpc.observe.actions import action_for, summary_for
from aihpc.observe.diagnosis import Diagnosis
from aihpc.observe.flight_recorder import StuckCollective, stuck_collectives
from aihpc.observe.logread import LogEvent, LogSet, plausible_rank, read_logs
from aihpc.runspec import RunSpec

__all__ = ["Diagnosis", "diagnose", "diagnose_logs"]

_FAILURE_TIERS = ("cause", "symptom", "follow_on")
_WEAK_CAUSES = ("killed",)
_WAITING = ("nccl_timeout", "collective_timeout", "hang", "heartbeat_timeout", "aborted")


def _key(e: LogEvent) -> tuple[float, int]:
    return (e.time if e.time is not None else math.inf, e.order)


def _single_node_ranks(logs: LogSet) -> None:
    """The elastic agent names workers by local rank; on one node that is the global rank. One
    node: at most one host named, and no torchrun summary pairing a rank with another local rank.
    """
    nodes = {e.node for e in logs.events if e.node}
    if len(nodes) > 1 or any(
        e.details.get("summary_local_rank", e.rank) != e.rank for e in logs.events
    ):
        return
    for e in logs.events:
        if e.rank is None and "local_rank" in e.details:
            e.rank = plausible_rank(e.details["local_rank"])
            logs.see(e.rank)


def _kills_after_hang(failures: list[LogEvent]) -> set[int]:
    """Ranks SIGKILLed after another rank's watchdog found a hang: aihpc's watchdog kills the
    stalled peers it finds, so those ranks are the stuck ones and their kill is a consequence."""
    hangs = [e for e in failures if e.cls == "hang"]
    if not hangs:
        return set()
    first = min(hangs, key=_key)
    culprits = set()
    for e in failures:
        peers = e.details.get("killed_peers")
        if e.cls == "hang" and isinstance(peers, list):
            culprits |= {p for p in map(plausible_rank, peers) if p is not None}
        if e.cls == "killed" and _key(e) > _key(first) and e.rank is not None:
            culprits.add(e.rank)
            e.tier = "follow_on"
    return culprits


def _pick_cause(failures: list[LogEvent]) -> LogEvent | None:
    """The earliest cause; a bare SIGKILL only when nothing explains it (the OOM killer's own
    line often prints after the launcher's)."""
    causes = [e for e in failures if e.tier == "cause"]
    strong = [e for e in causes if e.cls not in _WEAK_CAUSES]
    for candidates in (strong, causes):
        if candidates:
            return min(candidates, key=_key)
    for tier in _FAILURE_TIERS[1:]:
        candidates = [e for e in failures if e.tier == tier]
        if candidates:
            return min(candidates, key=_key)
    return None


def _behind(cause: LogEvent, logs: LogSet) -> set[int]:
    """Ranks whose watchdog reported a last enqueued collective before the one that timed out,
    in the same process group (sequence numbers count per group)."""
    seq = cause.details.get("seq")
    progress = [e for e in logs.events if e.cls == "nccl_progress" and e.rank is not None]
    if seq is None or not progress:
        return set()
    pgs = {e.details.get("pg") for e in progress if e.details.get("seq") == seq}
    pg = next(iter(pgs)) if len(pgs) == 1 else None
    return {
        e.rank
        for e in progress
        if (pg is None or e.details.get("pg") in (pg, None)) and e.details["enqueued"] < seq
    }


def _not_joined(
    cause: LogEvent,
    logs: LogSet,
    failures: list[LogEvent],
    stuck: list[StuckCollective],
    culprits: set[int],
) -> list[int]:
    """For a waiting-class failure: ranks the evidence says never entered the collective."""
    if cause.cls not in _WAITING:
        return []
    missing = set(culprits) | _behind(cause, logs)
    for s in stuck:
        missing |= set(s.missing)
    # ranks that reported nothing while the others waited (only when the world is known)
    world = set(range(logs.world_size)) if logs.world_size else set(logs.ranks_seen)
    waiting = {e.rank for e in failures if e.cls in _WAITING and e.rank is not None}
    if waiting and not missing and len(world) > len(waiting):
        missing |= world - waiting
    return sorted(missing)


def _follow_on(cause: LogEvent | None, failures: list[LogEvent]) -> list[dict[str, Any]]:
    by_rank: dict[Any, dict[str, Any]] = {}
    for e in sorted(failures, key=_key):
        if e is cause:
            continue
        key = e.rank if e.rank is not None else ("node", e.node)
        row = by_rank.setdefault(
            key, {"rank": e.rank, "node": e.node, "classes": {}, "first": e.text[:200]}
        )
        row["node"] = row["node"] or e.node
        row["classes"][e.cls] = row["classes"].get(e.cls, 0) + 1
    rows = list(by_rank.values())
    rows.sort(key=lambda r: (r["rank"] is None, r["rank"] if r["rank"] is not None else 0))
    return rows


def _fill_nodes(logs: LogSet) -> None:
    """A rank's node, where one line names both (torchrun's summary, NCCL's host prefix), for
    the rank's other lines."""
    nodes: dict[int, str] = {}
    for e in logs.events:
        if e.rank is not None and e.node and e.rank not in nodes:
            nodes[e.rank] = e.node
    for e in logs.events:
        if e.rank is not None and not e.node:
            e.node = nodes.get(e.rank)


def _borrow_place(cause: LogEvent | None, logs: LogSet) -> None:
    """A cause line that names no node or rank (Slurm's OOM notice) takes them from the next
    line of the same class that does (srun's 'node: task N: Out Of Memory')."""
    if cause is None or (cause.node and cause.rank is not None):
        return
    for e in sorted(logs.events, key=_key):
        if e.cls == cause.cls and e is not cause and _key(e) >= _key(cause):
            cause.node = cause.node or e.node
            cause.rank = e.rank if cause.rank is None else cause.rank
            if cause.node and cause.rank is not None:
                return


def diagnose_logs(logs: LogSet, spec: RunSpec | None = None) -> Diagnosis:
    """Diagnose what ``read_logs`` found."""
    _single_node_ranks(logs)
    _fill_nodes(logs)
    failures = [e for e in logs.events if e.tier in _FAILURE_TIERS]
    culprits = _kills_after_hang(failures)
    stuck = stuck_collectives(logs.flight_recorder) if logs.flight_recorder else []
    cause = _pick_cause(failures)
    if cause is None and stuck:
        cls = "collective_stuck"
        not_joined = sorted({r for s in stuck for r in s.missing})
    else:
        cls = cause.cls if cause else "none"
        not_joined = _not_joined(cause, logs, failures, stuck, culprits) if cause else []
    if cause is not None and cause.cls == "slurm_cancelled":
        cls = {
            "TIME LIMIT": "slurm_timeout",
            "PREEMPTION": "slurm_preempted",
            "NODE FAILURE": "node_failure",
            "JOB REQUEUE": "slurm_requeued",
        }.get(cause.details.get("reason", ""), "slurm_cancelled")
    # aihpc prints its summary (and logs "done") only when the run completed
    recovered = cause is not None and any(e.cls == "done" for e in logs.events)
    diag = Diagnosis(
        cause=cause,
        cls=cls,
        summary="",
        action="",
        not_joined=not_joined,
        stuck=stuck,
        follow_on=_follow_on(cause, failures),
        recovered=recovered,
        ranks_seen=sorted(logs.ranks_seen),
        files=logs.files,
        lines=logs.lines,
        timeline=sorted(failures, key=_key)[:20],
    )
    _borrow_place(cause, logs)
    progress = [e for e in logs.events if e.cls == "nccl_progress"]
    diag.frozen = bool(progress) and all(e.details.get("enqueued") == -1 for e in progress)
    diag.summary = summary_for(diag)
    diag.action = action_for(diag, spec)
    return diag


def diagnose(paths: list[Path], spec: RunSpec | None = None) -> Diagnosis:
    """Read ``paths`` (files or folders) and diagnose the job they came from."""
    return diagnose_logs(read_logs(paths), spec)
