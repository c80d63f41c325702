"""The one error type for bad input: it names the field, the value and what is allowed."""

from __future__ import annotations

from typing import Any

__all__ = ["SpecError"]


class SpecError(ValueError):
    """A user-facing input error. ``str(err)`` is one line: field, value, what is allowed.

    The CLI turns it into exit code 2 with that line and no traceback.
    """

    def __init__(self, field: str, value: Any, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"{field} = {value!r}: {allowed}")
