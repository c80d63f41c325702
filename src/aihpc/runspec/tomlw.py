"""Writing TOML: the subset a run spec uses (tables, sub-tables, scalars, lists, inline tables).

Python has ``tomllib`` to read TOML but nothing to write it; the run spec needs no more than this,
and ``dumps_toml`` output read back with ``tomllib.loads`` gives the same dict (tested).
"""

from __future__ import annotations

import math
import re
from typing import Any

__all__ = ["dumps_toml"]

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _string(key)


def _string(text: str) -> str:
    escaped = (
        text.replace("\\", "\\\\")
        .replace('"', '\\"')
        .replace("\n", "\\n")
        .replace("\t", "\\t")
        .replace("\r", "\\r")
    )
    return '"' + re.sub(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]", _control, escaped) + '"'


def _control(m: re.Match[str]) -> str:
    return f"\\u{ord(m.group(0)):04x}"


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def _table(name: str, table: dict[str, Any], lines: list[str]) -> None:
    scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
    subtables = {k: v for k, v in table.items() if isinstance(v, dict)}
    if name and (scalars or not subtables):
        lines += ["", f"[{name}]"]
    lines += [f"{_key(k)} = {_value(v)}" for k, v in scalars.items()]
    for key, sub in subtables.items():
        _table(f"{name}.{_key(key)}" if name else _key(key), sub, lines)


def dumps_toml(data: dict[str, Any], header: str = "") -> str:
    """``data`` as TOML text; ``header`` lines become comments at the top."""
    lines = [f"# {h}".rstrip() for h in header.splitlines()]
    _table("", data, lines)
    while lines and lines[0] == "":
        lines.pop(0)
    return "\n".join(lines) + "\n"
