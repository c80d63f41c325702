"""PyTorch flight-recorder dumps: which collective a job was stuck in and which ranks never
entered it.

A dump is one file per rank (``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` + rank, written on a watchdog
timeout with ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``, or by ``torch._C._distributed_c10d._dump_fr_trace``
on demand; gloo records too since PyTorch 2.7). The format (version 2.x) is a pickled dict:
``version``, ``pg_config``, ``pg_status`` ({pg: last_enqueued/started/completed_collective}) and
``entries`` (one per collective: ``collective_seq_id``, ``profiling_name`` such as
``nccl:all_reduce``, ``state`` scheduled / started / completed, ``process_group``, ``frames``).
PyTorch's own analyser is ``torch.distributed.flight_recorder`` (``torchfrtrace``).

The pickle is read with an unpickler that builds only dicts, lists, tuples, strings and numbers:
a dump is data from another machine, and ``pickle.load`` would run whatever it names.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aihpc.runspec.inputs import MAX_DEPTH, nesting_depth

__all__ = ["StuckCollective", "is_dump", "read_dump", "stuck_collectives"]

_RANK_SUFFIX = re.compile(r"(\d+)(?:\.json|\.pkl)?$")


class _DataOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"flight-recorder dump names {module}.{name}; refused")


def is_dump(path: Path) -> bool:
    """A file named ``<prefix><rank>`` holding a pickle (protocol 2+ magic) or a JSON object
    with ``entries``: what PyTorch writes (a DCP ``.metadata`` pickle is not one)."""
    if not _RANK_SUFFIX.search(path.name):
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    if head[:1] == b"\x80":
        return True
    return head.lstrip()[:1] == b"{" and b'"entries"' in head and b'"version"' in head


def read_dump(path: Path) -> tuple[int, dict[str, Any]]:
    """(rank, dump). The rank is the file name's trailing number, as PyTorch writes it."""
    m = _RANK_SUFFIX.search(path.name)
    if m is None:
        raise ValueError(f"{path}: a flight-recorder dump's name ends with its rank")
    if path.stat().st_size > MAX_DUMP_BYTES:
        raise ValueError(f"{path}: larger than {MAX_DUMP_BYTES >> 20} MiB; not read")
    data = path.read_bytes()
    if data[:1] == b"\x80":
        dump = _DataOnly(io.BytesIO(data)).load()
    else:
        text = data.decode("utf-8", "replace")
        if nesting_depth(text) > MAX_DEPTH:
            raise ValueError(f"{path}: nested deeper than {MAX_DEPTH} levels")
        dump = json.loads(text)
    _check_dump(dump, path)
    dump["_file"] = str(path)  # for the evidence a diagnosis quotes
    return int(m.group(1)), dump


_COUNTERS = ("last_enqueued_collective", "last_completed_collective")
# A dump holds ~2,000 entries of a few frames each (TORCH_NCCL_TRACE_BUFFER_SIZE): megabytes.
MAX_DUMP_BYTES = 256 << 20


def _check_dump(dump: Any, path: Path) -> None:
    """ValueError naming what is wrong when ``dump`` does not have the shape PyTorch writes:
    the analysis reads entries' sequence numbers, groups and frames, and pg_status counters."""
    if not isinstance(dump, dict) or not isinstance(dump.get("entries"), list):
        raise ValueError(f"{path}: not a flight-recorder dump (no list of entries)")
    status = dump.get("pg_status")
    if status is not None and not (
        isinstance(status, dict)
        and all(
            isinstance(v, dict) and all(_is_int(v.get(k, -1)) for k in _COUNTERS)
            for v in status.values()
        )
    ):
        raise ValueError(f"{path}: pg_status is not a table of counters per process group")
    for i, e in enumerate(dump["entries"]):
        if not isinstance(e, dict):
            raise ValueError(f"{path}: entries[{i}] is not a table")
        frames = e.get("frames")
        bad = (
            not _is_int(e.get("collective_seq_id", -1))
            or not (frames is None or isinstance(frames, list))
            or any(not isinstance(f, dict) for f in frames or [])
        )
        if bad:
            raise ValueError(f"{path}: entries[{i}] has a bad collective_seq_id or frames")


def _is_int(v: Any) -> bool:
    """An integer (a counter or sequence number), as PyTorch writes them."""
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class StuckCollective:
    pg: str
    seq: int
    op: str
    entered: tuple[int, ...]  # ranks that enqueued it
    missing: tuple[int, ...]  # ranks whose last enqueued collective comes before it
    last_enqueued: dict[int, int]
    frame: str  # the innermost user frame that called it, on a rank that entered
    # each entering rank's record of it: (profiling name, input sizes, the dump's file)
    records: dict[int, tuple[str, str, str]] = field(default_factory=dict)

    @property
    def mismatched(self) -> bool:
        """Ranks recorded different collectives (or sizes) under one sequence number: the
        program called them in a different order, not a network fault."""
        return len({(op, sizes) for op, sizes, _ in self.records.values()}) > 1

    def describe(self) -> str:
        where = f" (called from {self.frame})" if self.frame else ""
        if self.mismatched:
            ops = "; ".join(
                f"rank {r}: {op} {sizes}" for r, (op, sizes, _) in sorted(self.records.items())
            )
            return f"mismatched collectives at #{self.seq} on process group {self.pg}: {ops}"
        missing = ", ".join(map(str, self.missing)) or "none"
        return (
            f"{self.op} #{self.seq} on process group {self.pg}{where}: ranks "
            f"{', '.join(map(str, self.entered))} entered it; not joined: {missing}"
        )


def _pg_name(entry: dict[str, Any]) -> str:
    pg = entry.get("process_group")
    if isinstance(pg, list | tuple) and pg:
        return str(pg[0])
    return str(entry.get("pg_id", "0"))


def _user_frame(entry: dict[str, Any]) -> str:
    for fr in entry.get("frames") or []:
        name = str(fr.get("filename", ""))
        if "torch/" not in name and "site-packages" not in name:
            return f"{Path(name).name}:{fr.get('line')} {fr.get('name', '')}".strip()
    return ""


def _last_enqueued(dump: dict[str, Any], pg: str) -> int:
    status = (dump.get("pg_status") or {}).get(pg) or {}
    seqs = [
        int(e.get("collective_seq_id", -1))
        for e in dump.get("entries", [])
        if _pg_name(e) == pg and not e.get("is_p2p")
    ]
    return max([int(status.get("last_enqueued_collective", -1)), *seqs])


def _entry(dumps: dict[int, dict[str, Any]], pg: str, seq: int) -> tuple[str, dict[str, Any]]:
    for rank in sorted(dumps):
        for e in dumps[rank].get("entries", []):
            if _pg_name(e) == pg and not e.get("is_p2p") and e.get("collective_seq_id") == seq:
                return str(e.get("profiling_name", "?")), e
    return "?", {}


def _unfinished(dumps: dict[int, dict[str, Any]], pg: str) -> list[int]:
    """Sequence numbers some rank enqueued and did not complete (NCCL's state tracking; gloo
    marks a failed collective retired, so there only the enqueue counts tell)."""
    seqs = []
    for dump in dumps.values():
        done = int(
            ((dump.get("pg_status") or {}).get(pg) or {}).get("last_completed_collective", -1)
        )
        for e in dump.get("entries", []):
            seq = int(e.get("collective_seq_id", -1))
            if _pg_name(e) != pg or e.get("is_p2p") or seq <= done:
                continue
            if e.get("state") != "completed" and not e.get("retired"):
                seqs.append(seq)
    return seqs


def stuck_collectives(dumps: dict[int, dict[str, Any]]) -> list[StuckCollective]:
    """Per process group, the first collective that not every rank got through: the first one
    some rank never enqueued (those ranks had not joined), else the first one enqueued everywhere
    and completed nowhere (every rank joined; the fault is inside the collective)."""
    pgs = sorted({_pg_name(e) for d in dumps.values() for e in d.get("entries", [])})
    out = []
    for pg in pgs:
        last = {rank: _last_enqueued(d, pg) for rank, d in dumps.items()}
        seq: int | None = None
        if len(set(last.values())) > 1:
            seq = min(last.values()) + 1
        elif unfinished := _unfinished(dumps, pg):
            seq = min(unfinished)
        # a mismatch is found whatever the records' state (gloo retires a failed collective)
        mismatch = _first_mismatch(dumps, pg)
        if mismatch is not None and (seq is None or mismatch <= seq):
            seq = mismatch
        if seq is None:
            continue
        op, entry = _entry(dumps, pg, seq)
        entered = tuple(sorted(r for r, s in last.items() if s >= seq))
        missing = tuple(sorted(r for r, s in last.items() if s < seq))
        records = _records(dumps, pg, seq)
        out.append(
            StuckCollective(pg, seq, op, entered, missing, last, _user_frame(entry), records)
        )
    return out


def _first_mismatch(dumps: dict[int, dict[str, Any]], pg: str) -> int | None:
    """The first sequence number two ranks recorded as different collectives (or sizes)."""
    seqs = sorted(
        {
            int(e.get("collective_seq_id", -1))
            for d in dumps.values()
            for e in d.get("entries", [])
            if _pg_name(e) == pg and not e.get("is_p2p")
        }
    )
    for seq in seqs:
        records = _records(dumps, pg, seq)
        if len(records) > 1 and len({(op, sizes) for op, sizes, _ in records.values()}) > 1:
            return seq
    return None


def _records(
    dumps: dict[int, dict[str, Any]], pg: str, seq: int
) -> dict[int, tuple[str, str, str]]:
    out = {}
    for rank, dump in dumps.items():
        for e in dump.get("entries", []):
            if _pg_name(e) == pg and not e.get("is_p2p") and e.get("collective_seq_id") == seq:
                op = str(e.get("profiling_name", "?"))
                # all-to-all and gather/scatter sizes legitimately differ per rank
                sizes = (
                    ""
                    if re.search(r"all_?to_?all|gather$|scatter$", op)
                    else str(e.get("input_sizes", ""))
                )
                out[rank] = (op, sizes, str(dump.get("_file", f"dump of rank {rank}")))
    return out
