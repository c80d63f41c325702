"""What ``aihpc doctor`` concludes from a job's logs (``Diagnosis``), and its JSON: the first
failure, its class, the summary and action, the ranks that had not joined, the stuck
collectives and the failures that followed. doctor.py builds it; actions.py words it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aihpc.observe.flight_recorder import StuckCollective
from aihpc.observe.logread import LogEvent

__all__ = ["Diagnosis"]


@dataclass
class Diagnosis:
    cause: LogEvent | None
    cls: str
    summary: str
    action: str
    not_joined: list[int] = field(default_factory=list)
    # "ranks" (not_joined proved), "none" (every rank proved to have joined), "unknown" (the
    # logs do not say), None (no wait on a collective)
    not_joined_state: str | None = None
    silent: list[int] = field(default_factory=list)  # printed no wait of their own
    # every claim with the line that supports it: {claim, file, line, text}
    evidence: list[dict[str, Any]] = field(default_factory=list)
    stuck: list[StuckCollective] = field(default_factory=list)
    follow_on: list[dict[str, Any]] = field(default_factory=list)
    recovered: bool = False
    ranks_seen: list[int] = field(default_factory=list)
    files: int = 0
    lines: int = 0
    timeline: list[LogEvent] = field(default_factory=list)
    frozen: bool = False  # every rank's last enqueued collective is -1

    def to_json(self) -> dict[str, Any]:
        return {
            "class": self.cls,
            "summary": self.summary,
            "action": self.action,
            "first_failure": self.cause.to_json() if self.cause else None,
            "not_joined": self.not_joined,
            "not_joined_state": self.not_joined_state,
            "silent_ranks": self.silent,
            "evidence": self.evidence,
            "stuck_collectives": [
                {
                    "process_group": s.pg,
                    "seq": s.seq,
                    "op": s.op,
                    "entered": list(s.entered),
                    "not_joined": list(s.missing),
                    "mismatched": s.mismatched,
                    "called_from": s.frame,
                }
                for s in self.stuck
            ],
            "follow_on": self.follow_on,
            "recovered": self.recovered,
            "frozen_before_first_collective": self.frozen,
            "ranks_seen": self.ranks_seen,
            "files_read": self.files,
            "lines_read": self.lines,
            "timeline": [e.to_json() for e in self.timeline],
        }
