"""Typed reading of TOML tables into frozen dataclasses, with one-line errors.

Every spec class is a frozen dataclass; ``from_table`` checks that the table has no unknown keys and
that each value has the field's type (ints are accepted where floats are expected, bools never pass
as ints), then calls the class, whose ``__post_init__`` does the cross-field checks.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, TypeVar

from aihpc.runspec.errors import SpecError

T = TypeVar("T")

__all__ = ["check_choice", "check_positive", "from_table", "lookup_name", "to_table"]


def _allowed_types(tp: Any) -> tuple[type, ...]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        out: list[type] = []
        for arg in typing.get_args(tp):
            out.extend(_allowed_types(arg))
        return tuple(out)
    if origin is not None:
        return (origin,)
    if tp is type(None):
        return (type(None),)
    return (tp,)


def _coerce(value: Any, tp: Any, field: str) -> Any:
    allowed = _allowed_types(tp)
    if isinstance(value, bool) and bool not in allowed:
        raise SpecError(field, value, f"expected {_type_name(allowed)}")
    if isinstance(value, int) and not -(2**63) <= value < 2**63:  # TOML's integers are 64-bit
        raise SpecError(field, value, "an integer beyond 64 bits (TOML's are 64-bit)")
    if (
        isinstance(value, int)
        and not isinstance(value, bool)
        and float in allowed
        and int not in allowed
    ):
        return float(value)
    if dict in allowed and isinstance(value, dict):
        return value
    if not isinstance(value, allowed):
        raise SpecError(field, value, f"expected {_type_name(allowed)}")
    return value


def _type_name(allowed: tuple[type, ...]) -> str:
    names = {
        bool: "true/false",
        int: "an integer",
        float: "a number",
        str: "a string",
        dict: "a table",
        list: "a list",
        type(None): "nothing",
    }
    return " or ".join(names.get(t, t.__name__) for t in allowed if t is not type(None))


def from_table(cls: type[T], table: dict[str, Any], where: str, **extra: Any) -> T:
    """Build ``cls`` from a TOML table; unknown keys and wrong types raise SpecError."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = dict(extra)
    for key, value in table.items():
        if key not in fields or key in extra:
            known = ", ".join(sorted(k for k in fields if k not in extra))
            raise SpecError(f"{where}.{key}", value, f"unknown field; allowed: {known}")
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}")
    try:
        return cls(**kwargs)
    except TypeError as err:  # a required field is missing
        missing = [
            name
            for name, f in fields.items()
            if name not in kwargs
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise SpecError(f"{where}.{missing[0]}", None, "required field is missing") from err
        raise


def to_table(obj: Any) -> dict[str, Any]:
    """The dataclass as a plain dict (for JSON output), dropping private fields."""
    out = {}
    for f in dataclasses.fields(obj):
        if f.name.startswith("_"):
            continue
        value = getattr(obj, f.name)
        out[f.name] = to_table(value) if dataclasses.is_dataclass(value) else value
    return out


def check_positive(field: str, value: float | int | None, *, allow_zero: bool = False) -> None:
    """A count or a physical quantity: finite and > 0 (≥ 0 with ``allow_zero``); None passes."""
    if value is None:
        return
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise SpecError(field, value, "must be a finite number " + ("≥ 0" if allow_zero else "> 0"))


def check_choice(field: str, value: Any, choices: typing.Iterable[Any]) -> None:
    choices = list(choices)
    if value not in choices:
        raise SpecError(field, value, "allowed: " + " | ".join(str(c) for c in choices))


def lookup_name(field: str, value: Any, names: typing.Iterable[str]) -> str:
    """The catalog name ``value`` means: exact, else the one name equal to it ignoring case.

    Anything else is a SpecError that suggests the closest names ("did you mean") before
    listing every allowed one, so ``h100`` or ``llama-3-70b`` is answered with the right id.
    """
    names = sorted(names)
    if isinstance(value, str):
        if value in names:
            return value
        folded = [n for n in names if n.lower() == value.lower()]
        if len(folded) == 1:
            return folded[0]
        by_lower = {n.lower(): n for n in names}
        # names that contain what was typed first ("h100" -> "h100-sxm"), then look-alikes
        close = [n.lower() for n in names if value and value.lower() in n.lower()]
        close += difflib.get_close_matches(value.lower(), list(by_lower), n=3, cutoff=0.6)
        close = list(dict.fromkeys(by_lower[c] for c in close))[:3]
        if close:
            hint = "did you mean " + " or ".join(repr(c) for c in close) + "? allowed: "
            raise SpecError(field, value, hint + ", ".join(names))
    raise SpecError(field, value, "allowed: " + ", ".join(names))
