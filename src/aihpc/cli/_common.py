"""What every command shares: one-line errors with exit code 2, JSON output, the console."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from aihpc._io import to_json
from aihpc.spec.errors import SpecError

__all__ = ["console", "err_console", "fail", "guarded", "print_json"]

console = Console()
err_console = Console(stderr=True)
F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, code: int = 2) -> None:
    """Print one line on stderr and exit (2 = bad input)."""
    # The message is text, not markup: "[model]" or a list value must print as written.
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def guarded(func: F) -> F:
    """Turn SpecError into exit 2 with its one line; never a traceback for user error."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except SpecError as err:
            fail(str(err))
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def print_json(obj: Any) -> None:
    """One JSON document on stdout (NaN / inf become null so any parser reads it)."""
    sys.stdout.write(to_json(obj, indent=2) + "\n")
    sys.stdout.flush()
