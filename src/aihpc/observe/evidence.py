"""What ``aihpc doctor`` may claim about collectives, and the lines that prove it.

A claim without a quoted line is not made: which ranks had not joined a collective comes only
from a line or dump that says so (a rank's own last enqueued sequence number in the same process
group, the flight recorder, PyTorch's desync report), else it is ``unknown``; the ranks that
printed nothing are named as ranks to look at, never as the culprits (their logs may simply be
missing). A collective mismatch (ranks calling different collectives under one sequence number
of one process group) is a program bug, told apart from a network fault by the same rule.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from aihpc.observe.flight_recorder import StuckCollective
from aihpc.observe.logread import LogEvent, LogSet

__all__ = ["NotJoined", "mismatch_from_dumps", "mismatch_from_timeouts", "not_joined", "quote"]

WAITING = ("nccl_timeout", "collective_timeout", "hang", "heartbeat_timeout", "aborted")
# collectives whose input size is the same on every rank (all-to-all and p2p differ legitimately)
_SAME_SIZE_OPS = {"ALLREDUCE", "BROADCAST", "_ALLGATHER_BASE", "_REDUCE_SCATTER_BASE", "REDUCE"}
_SEQNUM = re.compile(r"SeqNum=(\d+)")
# send/recv count on their own sequence (seqP2P_), apart from the collectives' (seqCollective_)
_P2P_OPS = {"SEND", "RECV", "RECVANYSOURCE"}


def quote(e: LogEvent, claim: str) -> dict[str, Any]:
    """A claim and the line that supports it: file, line number, the line as printed."""
    return {"claim": claim, "file": e.file, "line": e.line, "text": e.text}


def _dump_quote(claim: str, file: str, text: str) -> dict[str, Any]:
    return {"claim": claim, "file": file, "line": 0, "text": text}


@dataclass
class NotJoined:
    """``state``: ``ranks`` (proved: ``ranks``), ``none`` (proved: every rank joined),
    ``unknown`` (the logs do not say), or None (the failure is no wait on a collective)."""

    state: str | None = None
    ranks: list[int] = field(default_factory=list)
    evidence: list[dict[str, Any]] = field(default_factory=list)
    # printed no wait of their own, or were killed stalled by aihpc's watchdog: look there
    silent: list[int] = field(default_factory=list)


_Index = dict[tuple[int | None, str, int], dict[int, LogEvent]]


def _group_index(events: list[LogEvent]) -> _Index:
    """(rank, file, sequence number) → {process group: the line naming both}: the watchdog's
    'detected by watchdog at work: N' lines, and teardown lines repeating 'SeqNum=N'."""
    index: _Index = {}
    for o in events:
        if o.details.get("pg") is None or o.cls not in ("nccl_progress", "teardown"):
            continue
        m = _SEQNUM.search(o.text) if o.cls == "teardown" else None
        seq = o.details.get("seq") if o.cls == "nccl_progress" else m and int(m.group(1))
        if isinstance(seq, int):
            index.setdefault((o.rank, o.file, seq), {}).setdefault(int(o.details["pg"]), o)
    return index


def _timeout_pg(e: LogEvent, index: _Index) -> tuple[int | None, LogEvent | None]:
    """The process group of a timed-out work: on its own line (2.6+ prefixes), else from the
    same rank's line that names the group and this sequence number."""
    if e.details.get("pg") is not None:
        return int(e.details["pg"]), None
    found = index.get((e.rank, e.file, e.details.get("seq", -1)), {})
    if len(found) == 1:
        pg, source = next(iter(found.items()))
        return pg, source
    return None, None


def mismatch_from_timeouts(events: list[LogEvent]) -> tuple[LogEvent, list[dict]] | None:
    """Ranks whose watchdogs timed out on different collectives (or sizes) under the same
    sequence number of the same process group: (the mismatch as an event, its evidence)."""
    groups: dict[tuple[int, int], dict[tuple, list]] = {}
    index = _group_index(events)
    for e in events:
        if e.cls != "nccl_timeout" or e.rank is None or "seq" not in e.details:
            continue
        if str(e.details.get("op")) in _P2P_OPS:
            continue
        pg, source = _timeout_pg(e, index)
        if pg is None:
            continue
        op = str(e.details.get("op"))
        key = (op, e.details.get("numel_in") if op in _SAME_SIZE_OPS else None)
        groups.setdefault((pg, int(e.details["seq"])), {}).setdefault(key, []).append((e, source))
    for (pg, seq), kinds in sorted(groups.items(), key=lambda kv: kv[0][1]):
        if len(kinds) < 2:
            continue
        firsts = [
            min(rows, key=lambda r: (r[0].time or 0.0, r[0].order)) for rows in kinds.values()
        ]
        first = min(firsts, key=lambda r: (r[0].time or 0.0, r[0].order))[0]
        ranks = {
            ",".join(str(r) for r in sorted({e.rank for e, _ in rows})): f"{op}"
            + (f" ({numel} elements)" if numel is not None else "")
            for (op, numel), rows in kinds.items()
        }
        evidence = []
        for e, source in firsts:
            evidence.append(quote(e, f"rank {e.rank} waited in {e.details.get('op')} #{seq}"))
            if source is not None:
                evidence.append(quote(source, f"rank {e.rank}'s #{seq} is on process group {pg}"))
        details = {"seq": seq, "pg": pg, "ops": ranks, "source": "watchdog timeouts"}
        ev = dataclasses.replace(first, cls="collective_mismatch", tier="cause", details=details)
        return ev, evidence
    return None


def mismatch_from_dumps(stuck: list[StuckCollective]) -> tuple[LogEvent, list[dict]] | None:
    """The flight recorder's records of one sequence number differ across ranks."""
    for s in stuck:
        if not s.mismatched:
            continue
        evidence = [
            _dump_quote(f"rank {r} recorded {op} as #{s.seq}", file, f"{op} {sizes}".strip())
            for r, (op, sizes, file) in sorted(s.records.items())
        ]
        first_file = evidence[0]["file"]
        ops = {str(r): f"{op} {sizes}".strip() for r, (op, sizes, _) in s.records.items()}
        ev = LogEvent(
            cls="collective_mismatch",
            tier="cause",
            time=None,
            order=0,
            file=first_file,
            line=0,
            rank=None,
            node=None,
            text=s.describe(),
            details={"seq": s.seq, "pg": s.pg, "ops": ops, "source": "flight recorder"},
        )
        return ev, evidence
    return None


def _ranks(text: Any) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", str(text))]


def _cause_pg(cause: LogEvent, index: _Index) -> int | None:
    if cause.cls != "nccl_timeout":
        return None
    return _timeout_pg(cause, index)[0]


def not_joined(
    cause: LogEvent | None,
    logs: LogSet,
    failures: list[LogEvent],
    stuck: list[StuckCollective],
    culprits: dict[int, LogEvent],
) -> NotJoined:
    """For a wait on a collective (or, with no cause, a collective the flight recorder shows
    stuck): the ranks the evidence says never entered it."""
    if cause is not None and cause.cls not in (*WAITING, "collective_stuck"):
        return NotJoined()
    missing: dict[int, list[dict]] = {}
    joined: set[int] = set()
    for s in stuck:
        joined |= set(s.entered)
        for r in s.missing:
            missing.setdefault(r, []).append(
                _dump_quote(
                    f"rank {r} had not joined {s.op} #{s.seq}",
                    str(logs.flight_recorder.get(r, {}).get("_file", "")),
                    f"rank {r}'s last enqueued collective on process group {s.pg}: "
                    f"#{s.last_enqueued.get(r)}; rank(s) {', '.join(map(str, s.entered))} "
                    f"entered #{s.seq}",
                )
            )
    for e in logs.events:
        if e.cls in ("fr_missing", "desync_missing"):
            for r in _ranks(e.details.get("ranks")):
                missing.setdefault(r, []).append(quote(e, f"rank {r} had not joined ({e.cls})"))
    # aihpc's watchdog kills every local peer without a heartbeat: the rank that never came
    # and those blocked waiting for it alike, so a kill shows a stalled rank, not an absent one
    if cause is not None:
        _sequence_evidence(cause, logs, missing, joined)
    world = set(range(logs.world_size)) if logs.world_size else set(logs.ranks_seen)
    waiting = {e.rank for e in failures if e.cls in WAITING and e.rank is not None}
    if missing:
        evidence = [q for r in sorted(missing) for q in missing[r]]
        return NotJoined("ranks", sorted(missing), evidence)
    if stuck and not any(s.missing for s in stuck):
        evidence = [
            _dump_quote("every rank entered it", rec[2], f"{s.op} #{s.seq} recorded by rank {r}")
            for s in stuck
            for r, rec in sorted(s.records.items())
        ]
        return NotJoined("none", [], evidence)
    # "every rank joined" needs the world's size from a line (NCCL's nranks, aihpc's summary):
    # the ranks seen are not the world when some ranks' logs are missing
    size_line = _world_line(logs)
    if size_line is not None and len(world) > 1 and world <= joined:
        return NotJoined("none", [], [quote(size_line, f"the world has {len(world)} ranks")])
    return NotJoined("unknown", [], [], sorted((world - joined - waiting) | set(culprits)))


def _world_line(logs: LogSet) -> LogEvent | None:
    if not logs.world_size:
        return None
    for e in logs.events:
        if logs.world_size in (e.details.get("nranks"), e.details.get("world")):
            return e
    return None


def _sequence_evidence(
    cause: LogEvent, logs: LogSet, missing: dict[int, list[dict]], joined: set[int]
) -> None:
    """Each rank's own last enqueued sequence number, in the timed-out work's process group
    (numbers count per group: a line whose group is unknown proves nothing)."""
    seq = cause.details.get("seq")
    index = _group_index(logs.events)
    pg = _cause_pg(cause, index)
    if seq is None or pg is None:
        return
    # a group whose works include send/recv: its 'last enqueued' may be a p2p number
    if any(
        e.cls == "nccl_timeout"
        and str(e.details.get("op")) in _P2P_OPS
        and _timeout_pg(e, index)[0] == pg
        for e in logs.events
    ):
        return
    for e in logs.events:
        if e.rank is None or (e.cls == "nccl_progress" and e.details.get("pg") != pg):
            continue
        if e.cls == "nccl_timeout" and e.details.get("seq") == seq:
            if _timeout_pg(e, index)[0] == pg:
                joined.add(e.rank)
        elif e.cls == "nccl_progress" and isinstance(e.details.get("enqueued"), int):
            if e.details["enqueued"] >= seq:
                joined.add(e.rank)
            else:
                missing.setdefault(e.rank, []).append(
                    quote(
                        e,
                        f"rank {e.rank} had not joined: its last enqueued work on process group "
                        f"{pg} is #{e.details['enqueued']}, before #{seq}",
                    )
                )
