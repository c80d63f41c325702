"""Read nccl-tests text output (``all_reduce_perf`` & co.) into rows, without torch.

Accepts what real runs print: the header of old (v2.13: ``[0x1b]`` bus ids, no version line) and
new (v2.19: ``# Collective test starting``, ``[0000:1b:00]``) builds, one ``#  Rank`` line per rank
(several hosts for a multi-node run), both out-of-place and in-place column groups (with
``#wrong``, the ``error`` column of very old builds, ``N/A`` when checking was off, or the
per-iteration ``-I 1`` columns), the ``# Avg bus bandwidth`` footer, and NCCL INFO or other lines
interleaved by the launcher. A file may hold several tests one after the other.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aihpc.bench.collectives import COLLECTIVES, NCCL_TESTS_BINARIES, NCCL_TESTS_COLUMNS
from aihpc.runspec.errors import SpecError
from aihpc.runspec.inputs import parse_json, read_input

__all__ = [
    "NcclRow",
    "NcclTest",
    "nccl_tests_json",
    "parse_nccl_tests",
    "read_nccl_tests_log",
]

# "Group" appeared in 2019; older builds print "#   Rank  0 Pid ... on host device 0 [0x06] name"
_RANK = re.compile(
    r"^#\s+Rank\s+(?P<rank>\d+)(?:\s+Group\s+\d+)?\s+Pid\s+\d+\s+on\s+(?P<host>\S+)"
    r"\s+device\s+\d+\s+\[[^\]]*\]\s*(?P<name>.*)$"
)
_STARTING = re.compile(r"^#\s*Collective test (?:starting|concluded):\s*(\S+)")
_AVG = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*(\S+)")
_OOB = re.compile(r"^#\s*Out of bounds values\s*:\s*(\d+)")
_PARAMS = re.compile(r"^#\s*nThread\s+(\d+)\s+nGpus\s+(\d+)\s+minBytes\s+(\d+)\s+maxBytes\s+(\d+)")
_BINARY_TO_COLL = {b.removesuffix("_perf"): c for c, b in NCCL_TESTS_BINARIES.items()}
_BINARY_TO_COLL.update({c: c for c in COLLECTIVES})


@dataclass(frozen=True)
class NcclRow:
    size_bytes: int
    count: int
    dtype: str
    redop: str
    root: int
    # out-of-place and in-place: (time_us, algbw_GBps, busbw_GBps, wrong or None)
    out_of_place: tuple[float, float, float, int | None]
    in_place: tuple[float, float, float, int | None] | None


@dataclass
class NcclTest:
    """One test run (one header, its rows and its footer)."""

    collective: str | None
    ranks: list[tuple[int, str, str]] = field(default_factory=list)  # (rank, host, device name)
    rows: list[NcclRow] = field(default_factory=list)
    avg_busbw_GBps: float | None = None
    out_of_bounds: int | None = None

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def hosts(self) -> list[str]:
        return sorted({h for _, h, _ in self.ranks})

    def mean_busbw(self) -> float:
        """Recomputed 'Avg bus bandwidth': mean busbw over every row, both column groups."""
        values = [r.out_of_place[2] for r in self.rows]
        values += [r.in_place[2] for r in self.rows if r.in_place is not None]
        return sum(values) / len(values) if values else 0.0


def _collective_from_name(name: str) -> str | None:
    base = Path(name).name.lower()
    # longest names first: "reduce_scatter" must not be taken for "reduce"
    for key in sorted(_BINARY_TO_COLL, key=len, reverse=True):
        if key in base or key.replace("_", "") in base.replace("_", ""):
            return _BINARY_TO_COLL[key]
    return None


def _number(tok: str) -> float:
    return float(tok)


def _group(tokens: list[str]) -> tuple[float, float, float, int | None]:
    time_us, algbw, busbw = (_number(t) for t in tokens[:3])
    wrong: int | None = None
    if len(tokens) > 3 and tokens[3] != "N/A":
        value = float(tokens[3])
        # very old builds printed a max-abs "error" (e.g. 2e-07) rather than a count of wrong
        # elements; only an integral value is a count
        wrong = int(value) if value == int(value) and "e" not in tokens[3].lower() else None
    return time_us, algbw, busbw, wrong


class _Layout:
    """Column positions taken from the ``#  size  count ...`` header line."""

    def __init__(self, names: list[str] | None = None) -> None:
        names = names or list(NCCL_TESTS_COLUMNS)
        starts = [i for i, n in enumerate(names) if n in ("time", "cputime")]
        self.preamble = starts[0] if starts else 5
        self.has_root = "root" in names[: self.preamble]
        self.width = (starts[1] - starts[0]) if len(starts) > 1 else len(names) - self.preamble
        self.groups = max(1, len(starts))


def _parse_row(tokens: list[str], layout: _Layout) -> NcclRow | None:
    need = layout.preamble + 3
    if len(tokens) < need or not tokens[0].isdigit() or not tokens[1].isdigit():
        return None
    try:
        root = int(tokens[4]) if layout.has_root else -1
        body = tokens[layout.preamble :]
        oop = _group(body[: layout.width][:4])
    except ValueError:
        return None
    inp = None
    if layout.groups > 1 and len(body) >= layout.width + 3:
        try:
            inp = _group(body[layout.width : 2 * layout.width][:4])
        except ValueError:  # an in-place half printed as N/A
            inp = None
    redop = tokens[3] if layout.preamble > 3 else "none"
    return NcclRow(int(tokens[0]), int(tokens[1]), tokens[2], redop, root, oop, inp)


def parse_nccl_tests(lines: Iterable[str], name: str = "") -> list[NcclTest]:
    """Every test found in the text; ``name`` (a file name) helps name the collective."""
    tests: list[NcclTest] = []
    current: NcclTest | None = None
    layout = _Layout()
    pending_name: str | None = None
    for raw in lines:
        line = raw.rstrip("\n")
        # launchers prefix lines ("0: " with srun -l, "[1,0]<stdout>:" with mpirun --tag-output)
        line = re.sub(r"^(\[\d+,\d+\]<stdout>:|\d+:\s)", "", line).rstrip()
        stripped = line.strip()
        if not stripped:
            continue
        if m := _STARTING.match(stripped):
            coll = _collective_from_name(m.group(1))
            if "starting" in stripped:
                pending_name = coll
            elif current is not None and current.collective is None:
                current.collective = coll
            continue
        if _PARAMS.match(stripped):
            current = NcclTest(collective=pending_name or _collective_from_name(name))
            tests.append(current)
            pending_name = None
            layout = _Layout()
            continue
        if current is None:
            continue
        if m := _RANK.match(stripped):
            current.ranks.append((int(m["rank"]), m["host"], m["name"].strip()))
        elif m := _AVG.match(stripped):
            try:
                current.avg_busbw_GBps = float(m.group(1))
            except ValueError:
                current.avg_busbw_GBps = None
        elif m := _OOB.match(stripped):
            current.out_of_bounds = int(m.group(1))
        elif stripped.startswith("#"):
            names = stripped.lstrip("#").split()
            if names[:2] == ["size", "count"]:
                layout = _Layout(names)
        elif row := _parse_row(stripped.split(), layout):
            current.rows.append(row)
    return tests


def read_nccl_tests_log(path: str | Path, collective: str | None = None) -> list[NcclTest]:
    """Parse a log file; every test must name its collective (or ``collective`` is given)."""
    path = Path(path)
    text = read_input(path, "LOG", "an nccl-tests log (text or -J JSON)", errors="replace")
    if text.lstrip().startswith("{"):  # the -J FILE output of nccl-tests
        doc = parse_json(text, "LOG", str(path))
        try:
            tests = [nccl_tests_json(doc, path.name)]
        except (KeyError, TypeError, ValueError, OverflowError) as err:
            raise SpecError("LOG", str(path), f"not nccl-tests -J output ({err!r})") from err
        tests = [t for t in tests if t.rows]
    else:
        tests = [t for t in parse_nccl_tests(text.splitlines(), path.name) if t.rows]
    if not tests:
        raise SpecError(
            "LOG",
            str(path),
            "no nccl-tests data rows found (expected the output of "
            "all_reduce_perf & co., with its '# nThread ...' header)",
        )
    for t in tests:
        if collective is not None:
            t.collective = collective
        if t.collective is None:
            raise SpecError(
                "--collective",
                None,
                f"{path.name} does not name its test; give one of: " + " | ".join(COLLECTIVES),
            )
        if not t.ranks:
            raise SpecError(
                "LOG",
                str(path),
                "no '#  Rank N Group ...' device lines: the number of ranks is unknown",
            )
    return tests


def _json_half(obj: Any) -> tuple[float, float, float, int | None] | None:
    if not isinstance(obj, dict):
        return None
    time_us = obj.get("time", obj.get("cpu_time"))
    wrong = obj.get("nwrong")
    return (
        float(time_us),
        float(obj["alg_bw"]),
        float(obj["bus_bw"]),
        None if wrong is None else int(wrong),
    )


def _typed(doc: dict[str, Any], key: str, kind: type) -> Any:
    """``doc[key]`` when it is a ``kind`` (empty when absent or null), else TypeError naming
    the key: nccl-tests writes ``config`` as an object, ``args`` and ``results`` as arrays."""
    value = doc.get(key)
    if value is None:
        return kind()
    if not isinstance(value, kind):
        raise TypeError(f"{key} is {type(value).__name__}, not {kind.__name__}")
    return value


def nccl_tests_json(doc: dict[str, Any], name: str = "") -> NcclTest:
    """One test from the file nccl-tests writes with ``-J FILE`` (v2.17+; ``src/util.cu``):
    ``args[0]`` names the binary, ``config.devices`` lists the ranks, ``results`` the rows."""
    if not isinstance(doc, dict):
        raise TypeError("the document is not a JSON object")
    args = _typed(doc, "args", list)
    test = NcclTest(_collective_from_name(str(args[0])) if args else _collective_from_name(name))
    for d in _typed(_typed(doc, "config", dict), "devices", list):
        test.ranks.append((int(d["rank"]), str(d["hostname"]), str(d.get("device_info", ""))))
    for r in _typed(doc, "results", list):
        if not isinstance(r, dict):
            raise TypeError(f"a results entry is {type(r).__name__}, not an object")
        oop = _json_half(r.get("out_of_place"))
        inp = _json_half(r.get("in_place"))
        if oop is None and inp is None:
            continue
        test.rows.append(
            NcclRow(
                int(r["size"]),
                int(r["count"]),
                str(r["type"]),
                str(r["redop"]),
                int(str(r["root"]).strip()),
                oop or inp,
                inp if oop is not None else None,
            )
        )
    avg = doc.get("average_bus_bandwidth")
    if isinstance(avg, dict) and avg.get("bandwidth") is not None:
        test.avg_busbw_GBps = float(avg["bandwidth"])
    oob = doc.get("out_of_bounds")
    if isinstance(oob, dict) and oob.get("count") is not None:
        test.out_of_bounds = int(oob["count"])
    return test
