"""Reading a user's input file: bounded before it is parsed.

Every reader of a run spec, calibration, framework config, config.json, CSV or nccl-tests log
reads through here, so a file that is not one (a folder, a FIFO, a device, gigabytes of
something else, a 100,000-deep JSON array that would blow the parser's recursion) is one line
naming the field, the value and what is allowed (exit 2), never a traceback or a hang.

It lives in ``runspec``, the bottom layer, because the run spec's own reader needs it; every
other layer may import it (docs/architecture.md).
"""

from __future__ import annotations

import json
import os
import re
import stat
import tomllib
from pathlib import Path
from typing import Any

from aihpc.runspec.errors import SpecError

__all__ = [
    "MAX_DEPTH",
    "MAX_INPUT_BYTES",
    "check_depth",
    "check_integers",
    "nesting_depth",
    "parse_json",
    "parse_toml",
    "read_input",
]

# The largest config, CSV or nccl-tests log read: the biggest real ones are well under 1 MiB
# (a 1,024-rank nccl-tests log with its device lines is ~0.2 MiB).
MAX_INPUT_BYTES = 16 << 20
# The deepest nesting of arrays / tables read: real configs nest 3-4 deep; Python's JSON and
# TOML parsers recurse once a level and fail near 1,000.
MAX_DEPTH = 64

_MIB = 1 << 20
# Strings (TOML's four kinds and JSON's one) and comments, removed before brackets are counted.
_STRINGS = re.compile(
    r'"""(?:[^\\]|\\.)*?"""'
    r"|'''.*?'''"
    r'|"(?:[^"\\\n]|\\.)*"'
    r"|'[^'\n]*'"
    r"|#[^\n]*",
    re.S,
)
_BRACKETS = re.compile(r"[\[\]{}]")


def read_input(
    path: str | Path,
    field: str,
    expected: str = "a text file",
    max_bytes: int = MAX_INPUT_BYTES,
    errors: str = "strict",
) -> str:
    """The text of ``path`` (UTF-8, a leading BOM dropped), or SpecError naming ``field``: no
    such file, a folder, larger than ``max_bytes``, not text. A pipe (``<(zcat runs.csv.gz)``)
    or a device is read too, up to ``max_bytes`` + 1 bytes
    (``errors="replace"`` reads bytes that are not UTF-8 as U+FFFD instead)."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise SpecError(field, str(path), "cannot be read (file not found)") from None
    except OSError as err:
        raise SpecError(field, str(path), f"cannot be read ({err.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        raise SpecError(field, str(path), f"is a directory; expected {expected}")
    too_big = f"larger than {max_bytes / _MIB:g} MiB; expected {expected}"
    if st.st_size > max_bytes:
        raise SpecError(field, str(path), too_big)
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)  # a file that grows while read is cut off here
    except OSError as err:
        raise SpecError(field, str(path), f"cannot be read ({err.strerror})") from None
    if len(data) > max_bytes:
        raise SpecError(field, str(path), too_big)
    try:
        return data.decode("utf-8-sig", errors)
    except UnicodeDecodeError as err:
        raise SpecError(
            field, str(path), f"not UTF-8 text (byte {err.start}); expected {expected}"
        ) from None


def nesting_depth(text: str) -> int:
    """The deepest nesting of ``[`` / ``{`` outside strings and comments (JSON and TOML), in one
    regex pass: cheap next to parsing, and it never recurses."""
    depth = deepest = 0
    for m in _BRACKETS.finditer(_STRINGS.sub("", text)):
        if m.group() in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def check_depth(text: str, field: str, value: Any, max_depth: int = MAX_DEPTH) -> None:
    """SpecError when ``text`` nests arrays or tables deeper than ``max_depth``."""
    if text.count("[") + text.count("{") <= max_depth:
        return  # too few brackets to nest that deep: no scan
    depth = nesting_depth(text)
    if depth > max_depth:
        raise SpecError(field, value, f"nested {depth} deep; at most {max_depth} levels are read")


def parse_json(text: str, field: str, value: Any, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` after the depth check; invalid JSON is SpecError naming ``field``."""
    check_depth(text, field, value, max_depth)
    try:
        doc = json.loads(text)
    except ValueError as err:
        raise SpecError(field, value, f"not valid JSON ({err})") from None
    except RecursionError:  # the scan above stops this first; the last resort
        raise SpecError(field, value, f"nested too deep; at most {max_depth} levels") from None
    check_integers(doc, field, value)
    return doc


def parse_toml(text: str, field: str, value: Any, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """``tomllib.loads`` after the depth check; invalid TOML is SpecError naming ``field``."""
    check_depth(text, field, value, max_depth)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise SpecError(field, value, f"not valid TOML: {err}") from None
    except RecursionError:
        raise SpecError(field, value, f"nested too deep; at most {max_depth} levels") from None
    check_integers(data, field, value)
    return data


def check_integers(doc: Any, field: str, value: Any) -> None:
    """SpecError when ``doc`` holds an integer beyond 64 bits: TOML's integers are 64-bit and
    JSON writers' too, and Python's unbounded ones overflow every float they meet (issue 42).
    Walked with a stack: dotted TOML keys nest tables without brackets."""
    stack: list[tuple[Any, str]] = [(doc, "")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, dict):
            stack.extend((v, f"{where}.{k}" if where else str(k)) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(node))
        elif isinstance(node, int) and not -(2**63) <= node < 2**63:
            digits = len(str(abs(node))) if abs(node) < 10**4000 else "thousands of"
            raise SpecError(
                field,
                value,
                f"{where or 'the document'} is a {digits}-digit integer; TOML and "
                "JSON integers are 64-bit",
            )
