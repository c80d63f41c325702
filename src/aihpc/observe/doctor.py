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
import re
from pathlib import Path
from typing import Any

from aihpc.observe.actions import action_for, summary_for
from aihpc.observe.diagnosis import Diagnosis
from aihpc.observe.evidence import (
    mismatch_from_dumps,
    mismatch_from_timeouts,
    not_joined,
    quote,
)
from aihpc.observe.flight_recorder import StuckCollective, stuck_collectives
from aihpc.observe.logread import LogEvent, LogSet, plausible_rank, read_logs
from aihpc.runspec import RunSpec

__all__ = ["Diagnosis", "diagnose", "diagnose_logs"]

_FAILURE_TIERS = ("cause", "symptom", "follow_on")
_WEAK_CAUSES = ("killed",)


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


def _kills_after_hang(failures: list[LogEvent]) -> dict[int, LogEvent]:
    """Ranks SIGKILLed after another rank's watchdog found a hang: aihpc's watchdog kills the
    stalled peers it finds, so their kill is a consequence (follow-on). They were stalled, which
    does not say whether they never joined or waited for one that did not: they are ranks to
    look at. Each with the line that names it (the kill, or the hang event listing the peers)."""
    hangs = [e for e in failures if e.cls == "hang"]
    if not hangs:
        return {}
    first = min(hangs, key=_key)
    culprits: dict[int, LogEvent] = {}
    for e in failures:
        peers = e.details.get("killed_peers")
        if e.cls == "hang" and isinstance(peers, list):
            for p in map(plausible_rank, peers):
                if p is not None:
                    culprits.setdefault(p, e)
        if e.cls == "killed" and _key(e) > _key(first) and e.rank is not None:
            culprits.setdefault(e.rank, e)
            e.tier = "follow_on"
    return culprits


_GPU_HARDWARE = ("xid", "gpu_lost")
_GPU_SOFTWARE = ("cuda_error", "nccl_error", "exception")
_SAME_FAULT_S = 300.0  # kernel-log clocks (dmesg -T) drift: a CUDA error this near is the same


def _pick_cause(failures: list[LogEvent]) -> LogEvent | None:
    """The earliest cause; a bare SIGKILL only when nothing explains it (the OOM killer's own
    line often prints after the launcher's); a CUDA error on a node whose kernel log shows its
    GPU lost (Xid, fallen off the bus) is that loss, whichever clock printed first."""
    causes = [e for e in failures if e.tier == "cause"]
    strong = [e for e in causes if e.cls not in _WEAK_CAUSES]
    for candidates in (strong, causes):
        if candidates:
            return _hardware_behind(min(candidates, key=_key), candidates)
    for tier in _FAILURE_TIERS[1:]:
        candidates = [e for e in failures if e.tier == tier]
        if candidates:
            return min(candidates, key=_key)
    return None


def _hardware_behind(cause: LogEvent, causes: list[LogEvent]) -> LogEvent:
    if cause.cls not in _GPU_SOFTWARE or not cause.node:
        return cause
    if cause.cls == "exception" and not re.search(r"CUDA|cuda|NCCL|nccl", cause.text):
        return cause  # an exception of the program's own: not the GPU's doing
    near = [
        e
        for e in causes
        if e.cls in _GPU_HARDWARE
        and e.node == cause.node
        and (e.time is None or cause.time is None or abs(e.time - cause.time) <= _SAME_FAULT_S)
    ]
    return min(near, key=_key) if near else cause


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


def _fill_nodes(logs: LogSet) -> dict[int, LogEvent]:
    """A rank's node, where one line names both (torchrun's summary, NCCL's host prefix), for
    the rank's other lines. Returns, per event filled (by its order), the line that named it."""
    nodes: dict[int, LogEvent] = {}
    for e in logs.events:
        if e.rank is not None and e.node and e.rank not in nodes:
            nodes[e.rank] = e
    filled = {}
    for e in logs.events:
        if e.rank is not None and not e.node and e.rank in nodes:
            e.node = nodes[e.rank].node
            filled[e.order] = nodes[e.rank]
    return filled


def _borrow_place(cause: LogEvent | None, logs: LogSet) -> list[dict[str, Any]]:
    """A cause line that names no node or rank (Slurm's OOM notice) takes them from the next
    line of the same class that does (srun's 'node: task N: Out Of Memory'); the lines lent
    from are quoted."""
    if cause is None or (cause.node and cause.rank is not None) or cause.order == 0:
        return []
    quotes = []
    for e in sorted(logs.events, key=_key):
        if e.cls == cause.cls and e is not cause and _key(e) >= _key(cause):
            lent = []
            if not cause.node and e.node:
                cause.node = e.node
                lent.append(f"node {e.node}")
            if cause.rank is None and e.rank is not None:
                cause.rank = e.rank
                lent.append(f"rank {e.rank}")
            if lent:
                quotes.append(quote(e, " and ".join(lent) + " of the first failure"))
            if cause.node and cause.rank is not None:
                break
    return quotes


def _mismatch(
    logs: LogSet, stuck: list[StuckCollective]
) -> tuple[LogEvent, list[dict[str, Any]]] | None:
    return mismatch_from_timeouts(logs.events) or mismatch_from_dumps(stuck)


def _cause_evidence(
    cause: LogEvent | None, filled: dict[int, LogEvent], cls: str
) -> list[dict[str, Any]]:
    if cause is None or cause.order == 0:  # none, or one built from flight-recorder dumps
        return []
    quotes = [quote(cause, f"first failure: {cls}" + (f", {cause.where()}"))]
    if cause.order in filled:
        src = filled[cause.order]
        quotes.append(quote(src, f"rank {src.rank} ran on node {src.node}"))
    return quotes


def diagnose_logs(logs: LogSet, spec: RunSpec | None = None) -> Diagnosis:
    """Diagnose what ``read_logs`` found."""
    _single_node_ranks(logs)
    filled = _fill_nodes(logs)
    failures = [e for e in logs.events if e.tier in _FAILURE_TIERS]
    culprits = _kills_after_hang(failures)
    stuck = stuck_collectives(logs.flight_recorder) if logs.flight_recorder else []
    mismatch = _mismatch(logs, stuck)
    cause = _pick_cause(failures + ([mismatch[0]] if mismatch else []))
    evidence: list[dict[str, Any]] = []
    cls = cause.cls if cause else ("collective_stuck" if stuck else "none")
    verdict = not_joined(cause, logs, failures, stuck, culprits) if cause or stuck else None
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
        not_joined=verdict.ranks if verdict else [],
        not_joined_state=verdict.state if verdict else None,
        silent=verdict.silent if verdict else [],
        stuck=stuck,
        follow_on=_follow_on(cause, failures),
        recovered=recovered,
        ranks_seen=sorted(logs.ranks_seen),
        files=logs.files,
        lines=logs.lines,
        timeline=sorted(failures, key=_key)[:20],
    )
    evidence += _cause_evidence(cause, filled, cls)
    evidence += _borrow_place(cause, logs)
    if mismatch and cause is mismatch[0]:
        evidence += mismatch[1]
    diag.evidence = evidence + (verdict.evidence if verdict else [])
    progress = [e for e in logs.events if e.cls == "nccl_progress"]
    diag.frozen = bool(progress) and all(e.details.get("enqueued") == -1 for e in progress)
    diag.summary = summary_for(diag)
    diag.action = action_for(diag, spec)
    return diag


def diagnose(paths: list[Path], spec: RunSpec | None = None) -> Diagnosis:
    """Read ``paths`` (files or folders) and diagnose the job they came from."""
    return diagnose_logs(read_logs(paths), spec)
