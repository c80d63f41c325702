"""Values written into the shell scripts aihpc generates (the sbatch script of ``aihpc launch``,
Megatron-LM's launch script of ``aihpc export``): no input may add a line or a command.

A shell word is refused when it holds a control character (a newline would end the command,
a carriage return hides text from a reader) and is otherwise ``shlex.quote``d. A ``#SBATCH``
directive is read by Slurm, not by the shell, and cannot be quoted: its value must match a
plain pattern. A comment shows its text with control characters escaped. (OWASP's command
construction guidance: validate what cannot be quoted, quote the rest.)"""

from __future__ import annotations

import re
import shlex
from typing import Any

from aihpc.runspec import SpecError

__all__ = ["comment_text", "directive_value", "env_name", "shell_word"]


def _has_control(text: str) -> bool:
    return any(not ch.isprintable() and ch != " " for ch in text)


def shell_word(field: str, value: Any) -> str:
    """``value`` as one shell word; SpecError naming ``field`` if it holds a control
    character."""
    text = str(value)
    if _has_control(text):
        raise SpecError(field, text, "a value without newlines or other control characters")
    return shlex.quote(text)


def directive_value(field: str, value: Any, pattern: str, allowed: str) -> str:
    """``value`` for a ``#SBATCH`` line when the whole of it matches ``pattern``; else
    SpecError naming ``field`` and ``allowed``."""
    text = str(value)
    if not re.fullmatch(pattern, text):
        raise SpecError(field, text, allowed)
    return text


def env_name(field: str, name: str) -> str:
    """An environment variable name the shell takes as one (ASCII letters, digits, _)."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise SpecError(field, name, "NAME=VALUE with NAME of letters, digits and _")
    return name


def comment_text(text: Any) -> str:
    """``text`` for a ``#`` comment: control characters shown escaped, never a line break."""
    return "".join(
        ch if ch.isprintable() or ch == " " else ch.encode("unicode_escape").decode("ascii")
        for ch in str(text)
    )
