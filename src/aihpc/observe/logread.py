"""Read a failed job's logs into events: which line, when, which rank and node, which class.

Inputs, by what they contain rather than their name: text logs (torchrun / srun output of any
number of ranks, NCCL debug output, kernel messages from dmesg, journalctl or syslog; ``.gz``
too), aihpc's ``events.jsonl``, and PyTorch flight-recorder dumps (``flight_recorder.py``).
Lines are streamed, and only those holding a keyword of some signature are matched.

Time: a line's own timestamp (glog ``E1218 20:27:21.426``, ISO, syslog ``Dec  1 10:00:00``,
``dmesg -T``, torchelastic's ``2026-12-02_03:13:22``), else the last one seen above it in the
same file. Times without a zone are local time; without a year, the year of the newest full date
in the inputs. ``dmesg`` seconds-since-boot cannot be placed and are ignored.
"""

from __future__ import annotations

import json
import pickle
import re
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from aihpc.observe.logfiles import binary, expand, open_text
from aihpc.observe.signatures import EXCEPTION_LINE, SIGNATURES, classify_exitcode
from aihpc.runspec.inputs import MAX_DEPTH, nesting_depth

__all__ = ["LogEvent", "LogSet", "read_logs"]

_KEYWORDS = re.compile(
    r"Xid|NET/IB : |Watchdog|watchdog|out of memory|Out Of Memory|OutOfMemory|oom|segfault|"
    r"Segmentation|SIGSEGV|CANCELLED|Node failure|Traceback|exitcode|closing signal|"
    r"CUDA error|nccl\w*Error|Cuda failure|Timed out|timeout|Timeout|Heartbeat|"
    r"Connection|Broken pipe|recvBytes|sendBytes|terminate called|what\(\)|NCCL operations|"
    r"data inconsistency|dump signal|death signal|srun: error|made no progress|DistNetworkError|"
    r"Fatal Python|host\s+:|rank\s+:|trained|final_step|world_size|NCCL INFO comm|"
    r"fallen off the bus|GPU is lost|mismatch between collectives|Culprit rank|"
    r"Not all ranks joining|missing ranks|lagging ranks"
)
# torchrun's "[rank3]:", srun --label's "3: ", torchrun --tee's "[default3]:" (role, local rank)
_RANK_PREFIX = re.compile(r"^\[(?:rank|Rank )(\d+)\]:\s?|^\s{0,3}(\d{1,6}): |^\[[a-z_]+(\d+)\]:")
_RANK_IN_TEXT = re.compile(r"\[(?:PG [^\]]*?)?Rank (\d+)\]|\[aihpc\.\w+ rank (\d+)\]")
_NCCL_HOST = re.compile(r"^(?P<host>[A-Za-z][\w.-]*):(?P<pid>\d+):(?P<tid>\d+) \[\d+\]")
_SYSLOG_HOST = re.compile(
    r"^(?:[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d|\d{4}-\d\d-\d\dT\S+) (?P<host>[\w.-]+) kernel:"
)
_HAS_TIME = re.compile(r"\d\d:\d\d:\d\d")
_GLOG = re.compile(r"(?:^|[\[\s])[EWIF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)(\.\d+)?\s")
_ISO = re.compile(r"(\d{4})-(\d\d)-(\d\d)[T _](\d\d):(\d\d):(\d\d)([.,]\d+)?")
_SYSLOG = re.compile(r"^([A-Z][a-z]{2}) ([ \d]\d) (\d\d):(\d\d):(\d\d)\s")
_DMESG_T = re.compile(r"^\[\w{3} (\w{3}) ([ \d]\d) (\d\d):(\d\d):(\d\d) (\d{4})\]")
_MONTHS = {
    m: i
    for i, m in enumerate(
        ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"], 1
    )
}
_FAILURE_FIELD = re.compile(r"^\s+(host|rank|exitcode)\s*: (.*)$")


@dataclass
class LogEvent:
    cls: str
    tier: str
    time: float | None
    order: int
    file: str
    line: int
    rank: int | None
    node: str | None
    text: str
    details: dict[str, Any] = field(default_factory=dict)

    def where(self) -> str:
        parts = []
        if self.rank is not None:
            parts.append(f"rank {self.rank}")
        if self.node:
            parts.append(f"node {self.node}")
        return ", ".join(parts) or "unknown rank"

    def to_json(self) -> dict[str, Any]:
        return {
            "class": self.cls,
            "tier": self.tier,
            "time_unix": self.time,
            "rank": self.rank,
            "node": self.node,
            "file": self.file,
            "line": self.line,
            "text": self.text,
            "details": self.details,
        }


@dataclass
class LogSet:
    """Everything read: events in input order, and facts about the job."""

    events: list[LogEvent] = field(default_factory=list)
    ranks_seen: set[int] = field(default_factory=set)
    world_size: int | None = None
    files: int = 0
    lines: int = 0
    flight_recorder: dict[int, dict[str, Any]] = field(default_factory=dict)
    _order: int = 0

    def add(self, **kw: Any) -> LogEvent:
        self._order += 1
        kw["rank"] = plausible_rank(kw.get("rank"))
        ev = LogEvent(order=self._order, **kw)
        self.events.append(ev)
        self.see(ev.rank)
        return ev

    def see(self, rank: Any) -> None:
        """Note a rank that printed, if it can be one."""
        if (rank := plausible_rank(rank)) is not None:
            self.ranks_seen.add(rank)

    def see_world(self, size: Any) -> None:
        """Note a world size a line names (the largest wins), if it can be one."""
        if plausible_rank(size) is not None and size > 0:
            self.world_size = max(self.world_size or 0, size)


# The most ranks a job has (a million GPUs): a "rank" or world size beyond it in a log is a
# number that happens to sit where a rank does, and counting up to it would take hours.
MAX_RANKS = 1 << 20


def plausible_rank(rank: Any) -> int | None:
    """``rank`` when it is an int in [0, MAX_RANKS], else None."""
    if isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank <= MAX_RANKS:
        return rank
    return None


def _timestamp(line: str, year: int) -> float | None:
    try:
        if m := _ISO.search(line[:64]):
            y, mo, d, h, mi, s, frac = m.groups()
            return _stamp(int(y), int(mo), int(d), int(h), int(mi), int(s), frac)
        if m := _GLOG.search(line[:48]):
            mo, d, h, mi, s, frac = m.groups()
            return _stamp(year, int(mo), int(d), int(h), int(mi), int(s), frac)
        if m := _DMESG_T.match(line):
            mon, d, h, mi, s, y = m.groups()
            return _stamp(int(y), _MONTHS[mon], int(d), int(h), int(mi), int(s), None)
        if (m := _SYSLOG.match(line)) and m.group(1) in _MONTHS:
            mon, d, h, mi, s = m.groups()
            return _stamp(year, _MONTHS[mon], int(d), int(h), int(mi), int(s), None)
    except (ValueError, OverflowError):
        return None
    return None


def _stamp(y: int, mo: int, d: int, h: int, mi: int, s: int, frac: str | None) -> float:
    base = datetime(y, mo, d, h, mi, s).timestamp()  # naive: local time
    return base + (float("0." + frac[1:]) if frac else 0.0)


def _full_year(paths: list[Path]) -> int:
    """The year of the newest full date in the first lines of the text inputs (else today's)."""
    best = None
    for path in paths:
        try:
            for i, line in enumerate(open_text(path)):
                if m := _ISO.search(line[:64]):
                    y = int(m.group(1))
                    best = y if best is None else max(best, y)
                if i > 2000:
                    break
        except (OSError, UnicodeError, EOFError):
            continue
    return best or time.localtime().tm_year


def _number(text: str) -> Any:
    """A captured field as a number when it is one (sequence numbers, exit codes, seconds)."""
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    if re.fullmatch(r"-?\d+\.\d+", text):
        return float(text)
    return text


def _node_from(line: str, path: Path) -> str | None:
    if m := _NCCL_HOST.match(line):
        return m.group("host")
    if m := _SYSLOG_HOST.match(line):
        return m.group("host")
    return None


def _kernel_file_node(path: Path) -> str | None:
    """``dmesg-gpu07.txt`` → ``gpu07``: dmesg output names no host, its file may."""
    stem = path.name.split(".")[0]
    m = re.match(r"^(?:dmesg|kern|kernel|syslog|journal)[-_]?(.+)$", stem)
    return m.group(1) if m and m.group(1) else None


# aihpc train's last line from a failed rank: "error: rank 1: InjectedFault: ... (traceback in
# RUN_DIR/logs/rank-1.attempt-0.log)" (src/aihpc/cli/train.py, _worker_line).
AIHPC_ERROR = re.compile(
    r"^error: rank (?P<rank>\d+): (?P<exc>[A-Za-z_][\w.]*: .*?) \(traceback in \S+\)$"
)


class _FileReader:
    """One text file: prefixes, timestamps, tracebacks and torchelastic failure blocks."""

    def __init__(self, logs: LogSet, path: Path, year: int):
        self.logs, self.path, self.year = logs, path, year
        self._last_time: float | None = None
        self._stamp_line: str | None = None  # the last line with a time in it, parsed lazily
        self.untimed: list[LogEvent] = []  # events above the file's first timestamp
        self.in_traceback: dict[tuple[int | None, int | None], bool] = {}
        self.failure: dict[str, str] = {}
        self.root_next = False
        self.local: int | None = None  # the line's local rank, from a "[default3]:" prefix
        self.file_node = _kernel_file_node(path)

    def read(self) -> None:
        for n, raw in enumerate(open_text(self.path), 1):
            self.logs.lines += 1
            line = raw.rstrip("\n")
            # Parsing a time costs more than the rest of a line: only note where the last one
            # is, and parse it when a matched line needs it.
            if _HAS_TIME.search(line, 0, 64):
                self._stamp_line = line
                if self.untimed and (stamp := self.last_time) is not None:
                    for ev in self.untimed:  # before this line: no later than it
                        ev.time = stamp
                    self.untimed = []
            m = _RANK_PREFIX.match(line)
            rank = int(m.group(1) or m.group(2)) if m and not m.group(3) else None
            self.local = int(m.group(3)) if m and m.group(3) else None
            body = line[m.end() :] if m else line
            if rank is None and body.startswith("[aihpc.") and (r := _RANK_IN_TEXT.match(body)):
                rank = int(r.group(2))
            rank = plausible_rank(rank)
            self.logs.see(rank)
            self._line(n, body, rank, line)

    @property
    def last_time(self) -> float | None:
        """The time of the last line above that has one (parsed on demand)."""
        if self._stamp_line is not None:
            stamp = _timestamp(self._stamp_line, self.year)
            self._stamp_line = None
            if stamp is not None:
                self._last_time = stamp
        return self._last_time

    @last_time.setter
    def last_time(self, value: float | None) -> None:
        self._stamp_line, self._last_time = None, value

    def _line(self, n: int, body: str, rank: int | None, line: str) -> None:
        if self._traceback(n, body, rank, line):
            return
        if (e := AIHPC_ERROR.match(body)) is not None:
            # aihpc train's one line for a failed rank (its traceback is in RUN_DIR/logs)
            self._exception(n, e.group("exc"), int(e.group("rank")), line)
            return
        if "Root Cause (first observed failure)" in body:
            self.root_next = True
        if (f := _FAILURE_FIELD.match(body)) is not None:
            self._failure_field(n, f.group(1), f.group(2), line)
            return
        if not _KEYWORDS.search(body):
            return
        for sig in SIGNATURES:
            if m := sig.pattern.search(body):
                self._emit(n, sig.cls, sig.tier, body, rank, line, m.groupdict())
                return

    def _emit(self, n, cls, tier, body, rank, line, details) -> None:
        details = {k: _number(v) for k, v in details.items() if v is not None}
        if rank is None and (m := _RANK_IN_TEXT.search(body)):
            rank = int(m.group(1) or m.group(2))
        if rank is None and self.local is not None:
            details.setdefault("local_rank", self.local)
        node = details.pop("node", None) or _node_from(line, self.path)
        if node is None and cls in ("xid", "gpu_lost", "segfault", "host_oom"):
            node = self.file_node
        if pg := re.search(r"\[PG (?:ID )?(\d+)", body):
            details["pg"] = int(pg.group(1))
        if cls == "worker_failed":
            cls, tier = classify_exitcode(int(details["exitcode"]))
            details["source"] = "agent"
        if isinstance(details.get("at"), str) and (at := _timestamp(details["at"], self.year)):
            self.last_time = at  # Slurm's "CANCELLED AT <time>" is the line's own time
        if cls == "ib_error" and details.get("status") == 5:
            tier = "follow_on"  # IBV_WC_WR_FLUSH_ERR: the queue pair was already in error
        if cls == "nccl_comm":  # NCCL's rank in the default communicator: the global rank
            rank = details["comm_rank"] if rank is None else rank
            if details.get("pg") in (None, 0):
                self.logs.see_world(details["nranks"])
        if isinstance(details.get("world"), int):  # aihpc's summary names the world size
            self.logs.see_world(details["world"])
        if rank is None and isinstance(details.get("tasks"), int):
            rank = details["tasks"]  # srun's task id is the global rank (one task per GPU)
        ev = self.logs.add(
            cls=cls,
            tier=tier,
            time=self.last_time,
            file=str(self.path),
            line=n,
            rank=rank,
            node=node,
            text=line.strip()[:400],
            details=details,
        )
        if ev.time is None:
            self.untimed.append(ev)

    def _traceback(self, n: int, body: str, rank: int | None, line: str) -> bool:
        """Emit the exception that ends a Python traceback; True if the line was consumed."""
        who = (rank, self.local)
        if body.startswith("Traceback (most recent call last)"):
            self.in_traceback[who] = True
            return True
        if not self.in_traceback.get(who):
            return False
        if body.startswith((" ", "\t")) or not body.strip():
            return True  # a frame or its source line
        self.in_traceback[who] = False
        return self._exception(n, body.strip(), rank, line)

    def _exception(self, n: int, body: str, rank: int | None, line: str) -> bool:
        """An exception line ``pkg.Type: message``: its own class when the message names a
        distributed failure (a peer gone, a timeout), else an exception that causes one."""
        m = EXCEPTION_LINE.match(body)
        if m is None:
            return False
        for sig in SIGNATURES:
            if sig.tier in ("follow_on", "symptom", "cause") and sig.pattern.search(body):
                self._emit(
                    n, sig.cls, sig.tier, body, rank, line, sig.pattern.search(body).groupdict()
                )
                return True
        self._emit(n, "exception", "cause", body, rank, line, m.groupdict())
        return True

    def _failure_field(self, n: int, key: str, value: str, line: str) -> None:
        """torchelastic's ChildFailedError block: host, rank, then exitcode ends one failure."""
        self.failure[key] = value.strip()
        if key != "exitcode":
            return
        code = re.match(r"(-?\d+)", self.failure["exitcode"])
        rank = re.match(r"(\d+)(?: \(local_rank: (\d+)\))?", self.failure.get("rank", ""))
        if code is None:
            return
        cls, tier = classify_exitcode(int(code.group(1)))
        details = {"exitcode": int(code.group(1)), "source": "summary", "root": self.root_next}
        if rank and rank.group(2):
            details["summary_local_rank"] = int(rank.group(2))
        self.root_next = False
        self.logs.add(
            cls=cls,
            tier=tier,
            time=self.last_time,
            file=str(self.path),
            line=n,
            rank=int(rank.group(1)) if rank else None,
            node=self.failure.get("host"),
            text=line.strip(),
            details=details,
        )
        self.failure = {}


# aihpc writes each event on one short line; a longer one is not aihpc's (and a deep one would
# blow the JSON parser's recursion).
MAX_EVENT_CHARS = 64 << 10


_LAST_SECOND = 253402300799  # 9999-12-31 23:59:59 UTC: the last time a clock can print


def _seconds(value: Any) -> float | None:
    """An event's ``time_unix`` as seconds, or None when it is not a plausible time."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        out = float(value)
    except OverflowError:  # an int beyond a float's range
        return None
    return out if 0 <= out <= _LAST_SECOND else None


def _read_events_jsonl(logs: LogSet, path: Path) -> None:
    """aihpc's run event log: faults injected, hangs detected, starts and ends."""
    for n, raw in enumerate(open_text(path), 1):
        logs.lines += 1
        if len(raw) > MAX_EVENT_CHARS or nesting_depth(raw) > MAX_DEPTH:
            continue
        try:
            ev = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(ev, dict):
            continue  # not one of aihpc's events: skipped as the reader skips a foreign line
        rank, kind, when = plausible_rank(ev.get("rank")), ev.get("event"), ev.get("time_unix")
        when = _seconds(when)
        logs.see(rank)
        logs.see_world(ev.get("world_size"))
        mapping = {
            "fault": ("injected_fault", "cause"),
            "hang_detected": ("hang", "symptom"),
            "done": ("done", "context"),
            "process_start": ("start", "context"),
        }
        if kind not in mapping:
            continue
        cls, tier = mapping[kind]
        details = {k: v for k, v in ev.items() if k not in ("event", "rank", "time_unix")}
        logs.add(
            cls=cls,
            tier=tier,
            time=when,
            file=str(path),
            line=n,
            rank=rank,
            node=None,
            text=raw.strip()[:400],
            details=details,
        )


def _is_events_jsonl(path: Path) -> bool:
    try:
        first = next(iter(open_text(path)), "")
        return first.startswith("{") and '"event"' in first
    except (OSError, UnicodeError):
        return False


def read_logs(paths: list[Path]) -> LogSet:
    """Read files and folders (recursively) into one LogSet."""
    from aihpc.observe.flight_recorder import is_dump, read_dump

    files = expand(paths)
    logs = LogSet()
    dumps = [p for p in files if is_dump(p)]
    texts = [p for p in files if p not in dumps and not binary(p)]
    year = _full_year(texts)
    for path in dumps:
        logs.files += 1
        try:
            rank, dump = read_dump(path)
        except (pickle.UnpicklingError, ValueError, EOFError, OSError) as err:
            _unreadable(logs, path, err)
            continue
        logs.flight_recorder[rank] = dump
        logs.see(rank)
    for path in texts:
        logs.files += 1
        if _is_events_jsonl(path):
            _read_events_jsonl(logs, path)
        else:
            try:
                _FileReader(logs, path, year).read()
            except (OSError, EOFError) as err:  # unreadable: say so, read the rest
                _unreadable(logs, path, err)
    return logs


def _unreadable(logs: LogSet, path: Path, err: Exception) -> None:
    logs.add(
        cls="unreadable",
        tier="context",
        time=None,
        file=str(path),
        line=0,
        rank=None,
        node=None,
        text=f"{type(err).__name__}: {err}",
    )
