"""The run directory's records read back as data: each line of ``metrics.jsonl`` and
``events.jsonl``, and ``summary.json``, checked against what the trainer writes before anything
acts on it.

A check is a pure function from a parsed record to None (sound) or the one thing wrong with it,
"FIELD = VALUE, not WHAT IS ALLOWED". A damaged record is named on one line and skipped; its bytes
are kept beside the file (``NAME.damaged``), never deleted in silence. Nothing here needs torch.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aihpc.runspec import SpecError

__all__ = [
    "JsonlRead",
    "event_problem",
    "lost_steps",
    "metrics_problem",
    "read_jsonl",
    "repair_records",
    "set_aside",
    "steps_text",
    "summary_problem",
]

Check = Callable[[Any], "str | None"]

_SHOWN = 5  # damaged lines named one by one per file; the rest are counted in one line
_HEX_FLOAT = re.compile(r"^-?(0x[0-9a-f]+(\.[0-9a-f]*)?p[+-]?\d+|inf|nan)$", re.IGNORECASE)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _show(value: Any) -> str:
    text = json.dumps(value)  # parsed from JSON: it serialises back
    return text if len(text) <= 40 else text[:37] + "..."


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    return names.get(type(value), "null" if value is None else "a number")


def _int(record: dict, field: str, minimum: int, required: bool = True) -> str | None:
    if field not in record and not required:
        return None
    value = record.get(field)
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{field} = {_show(value)}, not an integer"
    if value < minimum:
        return f"{field} = {value}, not an integer >= {minimum}"
    return None


def _number(record: dict, field: str, nullable: bool) -> str | None:
    value = record.get(field)
    if value is None and nullable and field in record:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return f"{field} = {_show(value)}, not a finite number" + (" or null" if nullable else "")
    return None


def metrics_problem(record: Any) -> str | None:
    """A line of metrics.jsonl: ``step`` (an integer >= 1) and ``loss_hex`` (the loss as
    ``float.hex``, which resume compares bit for bit) are what a resume reads."""
    if not isinstance(record, dict):
        return f"{_kind(record)}, not an object"
    hexed = record.get("loss_hex")
    return _int(record, "step", 1) or (
        None
        if isinstance(hexed, str) and _HEX_FLOAT.match(hexed)
        else f"loss_hex = {_show(hexed)}, not a float in hex"
    )


def event_problem(record: Any) -> str | None:
    """A line of events.jsonl as ``rundir.Events`` writes it: ``event``, ``rank``, ``attempt``,
    ``time_unix``, and ``step`` where the event has one."""
    if not isinstance(record, dict):
        return f"{_kind(record)}, not an object"
    event = record.get("event")
    if not isinstance(event, str) or not event:
        return f"event = {_show(event)}, not an event name"
    return (
        _int(record, "rank", 0)
        or _int(record, "attempt", 0)
        or _number(record, "time_unix", nullable=False)
        or _int(record, "step", 0, required=False)
    )


def summary_problem(summary: Any) -> str | None:
    """summary.json: the fields a resume, an extension and the `already finished` line read."""
    if not isinstance(summary, dict):
        return f"{_kind(summary)}, not an object"
    sha = summary.get("state_sha256")
    history = summary.get("history", [])
    return (
        _int(summary, "final_step", 0)
        or _int(summary, "resumed_from_step", 0, required=False)
        or (None if "final_loss" not in summary else _number(summary, "final_loss", True))
        or (
            None
            if isinstance(sha, str) and _SHA256.match(sha)
            else f"state_sha256 = {_show(sha)}, not 64 hex digits"
        )
        or (
            None
            if isinstance(history, list) and all(isinstance(h, dict) for h in history)
            else f"history = {_show(history)}, not a list of objects"
        )
    )


@dataclass(frozen=True)
class JsonlRead:
    """A JSON-lines file read back: its sound records (line number, bytes, record), its damaged
    lines (line number, bytes, what is wrong) and a torn last line (no newline: a write cut
    short by a crash or a full disk), if any."""

    sound: list[tuple[int, bytes, dict]]
    damaged: list[tuple[int, bytes, str]]
    torn: bytes = b""


def read_jsonl(path: Path, check: Check) -> JsonlRead:
    """Every line of ``path`` checked by ``check`` (a missing file reads as empty)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return JsonlRead([], [])
    except OSError as err:
        raise SpecError("--run-dir", str(path), f"cannot be read ({err.strerror})") from err
    body, _, torn = raw.rpartition(b"\n") if not raw.endswith(b"\n") else (raw, b"", b"")
    sound, damaged = [], []
    for number, line in enumerate(body.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode())
        except UnicodeDecodeError as err:
            damaged.append((number, line, f"not UTF-8 (byte 0x{line[err.start]:02x} at column "
                                          f"{err.start + 1})"))  # fmt: skip
            continue
        except (ValueError, RecursionError) as err:
            damaged.append((number, line, f"not JSON ({str(err)[:60]})"))
            continue
        problem = check(record)
        if problem:
            damaged.append((number, line, problem))
        else:
            sound.append((number, line, record))
    return JsonlRead(sound, damaged, torn)


def set_aside(path: Path) -> Path:
    """Rename ``path`` (a file or a folder) to ``NAME.damaged`` (``.damaged.2``, ... when taken)
    beside it; the new path. Kept for a person to look at; nothing is deleted."""
    dest, n = path.with_name(path.name + ".damaged"), 1
    while dest.exists() or dest.is_symlink():
        n += 1
        dest = path.with_name(f"{path.name}.damaged.{n}")
    os.replace(path, dest)
    return dest


def _keep_bytes(path: Path, chunks: Iterable[bytes]) -> Path:
    """Append ``chunks`` (one line each) to ``NAME.damaged`` beside ``path``; its path."""
    dest = path.with_name(path.name + ".damaged")
    if (dest.exists() or dest.is_symlink()) and not dest.is_file():
        set_aside(dest)  # an odd thing in the way is kept too
    with open(dest, "ab") as f:
        f.write(b"".join(c.rstrip(b"\n") + b"\n" for c in chunks))
    return dest


def repair_records(path: Path, check: Check) -> list[str]:
    """Before anything is appended to a JSON-lines log: move its torn last line and every
    damaged line to ``NAME.damaged`` (a folder in its place is set aside whole), one line each
    (the first few, then a count)."""
    if path.is_dir() or (path.exists() and not path.is_file()):
        dest = set_aside(path)
        return [f"{path.name} is not a file; moved to {dest.name}, and a new {path.name} begun"]
    read = read_jsonl(path, check)
    if not read.damaged and not read.torn:
        return []
    kept = _keep_bytes(path, [line for _, line, _ in read.damaged] + [read.torn] * bool(read.torn))
    notes = [
        f"{path.name} line {number}: {problem}; line skipped (kept in {kept.name})"
        for number, _, problem in read.damaged[:_SHOWN]
    ]
    if len(read.damaged) > _SHOWN:
        notes.append(f"{path.name}: {len(read.damaged) - _SHOWN} more damaged lines skipped "
                     f"(kept in {kept.name})")  # fmt: skip
    if read.torn:
        notes.append(f"{path.name}: cut a torn last line of {len(read.torn)} bytes (kept in "
                     f"{kept.name})")  # fmt: skip
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(b"".join(line + b"\n" for _, line, _ in read.sound))
    os.replace(tmp, path)
    return notes


def lost_steps(logged: Iterable[int], through: int) -> list[list[int]]:
    """The steps 1..``through`` that ``logged`` lacks, as [first, last] ranges."""
    have, out = set(logged), []
    for step in range(1, through + 1):
        if step in have:
            continue
        if out and out[-1][1] == step - 1:
            out[-1][1] = step
        else:
            out.append([step, step])
    return out


def steps_text(ranges: list[list[int]]) -> str:
    """[[1, 4], [7, 7]] -> "1-4, 7"."""
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in ranges)
