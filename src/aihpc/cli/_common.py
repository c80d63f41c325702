"""What every command shares: one-line errors with exit code 2, JSON output, the console.

``console`` and ``err_console`` are made on first use, and rich is imported there: it cost
~0.04 s of CPU of an ``aihpc search --json`` process, which never prints through them (issue
21's whole-process budget). Modules on that path read them as ``_common.console``; the others may
import the names.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import typer
from typer.core import TyperArgument, TyperGroup, TyperOption

from aihpc._io import to_json
from aihpc.runspec.errors import SpecError

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "OLD_OUTPUT",
    "RUNSPEC_HELP",
    "HelpGroup",
    "console",
    "err_console",
    "fail",
    "guarded",
    "print_json",
    "renamed_output",
    "require_torch",
]

# Typer renders help as rich markup, where "[model]" would be read as a style tag: escaped.
RUNSPEC_HELP = r"Run spec TOML (\[model], \[cluster], \[parallel], \[training])."
# Width of output that does not go to a terminal (a pipe, a file, `tee`): wide enough that no
# table is cut to "…" and no line is wrapped. Rich would otherwise take 80 columns, or the width
# of the terminal that stdin or $COLUMNS names, and a log would keep the cut copy.
PIPE_WIDTH = 1000


@functools.cache
def _console(*, stderr: bool) -> Console:
    """The one stdout (or stderr) console, made on first use."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        tty = False
    return Console(stderr=stderr, width=None if tty else PIPE_WIDTH)


# Declared for readers and type checkers; the module's __getattr__ makes them on first use.
console: Console
err_console: Console


def __getattr__(name: str) -> Console:
    if name == "console":
        return _console(stderr=False)
    if name == "err_console":
        return _console(stderr=True)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, code: int = 2) -> None:
    """Print one line on stderr and exit (2 = bad input)."""
    from rich.markup import escape

    # The message is text, not markup: "[model]" or a list value must print as written.
    _console(stderr=True).print(
        f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True
    )
    raise typer.Exit(code)


def _tidy(command: Any) -> None:
    """One look for every command's help, whoever wrote it: an argument is named in capitals
    (RUNSPEC, as the error lines name it) and an on/off flag shows no value placeholder
    (typer would print ``--json <bool>``, as if it took a value)."""
    for param in command.params:
        if isinstance(param, TyperOption) and param.is_flag and param.metavar is None:
            param.metavar = ""
        elif isinstance(param, TyperArgument) and param.metavar is None and param.name:
            param.metavar = param.name.upper()
    if not getattr(command, "_aihpc_tidy", False):  # -h/--help is made lazily, per command
        command._aihpc_tidy = True
        made = command.get_help_option

        def get_help_option(ctx: Any) -> Any:
            option = made(ctx)
            if option is not None and option.metavar is None:
                option.metavar = ""
            return option

        command.get_help_option = get_help_option
    for sub in getattr(command, "commands", {}).values():
        _tidy(sub)


class HelpGroup(TyperGroup):
    """The root command group: tidies the help of the whole command tree before it is used."""

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        _tidy(self)
        return super().make_context(*args, **kwargs)


def require_torch(command: str) -> None:
    """Exit 2 with one line when PyTorch, which ``command`` needs, is not installed.

    The planner installs without torch (README's first command); the commands that run tensors
    say what to install instead of failing on an import 40 lines deep.
    """
    if importlib.util.find_spec("torch") is None:
        fail(
            f"`aihpc {command}` needs PyTorch, which is not installed: in the aihpc checkout, "
            "python3 -m pip install -e '.[torch]' (on a machine without a GPU, first "
            "python3 -m pip install torch --index-url https://download.pytorch.org/whl/cpu, "
            "the CPU build)"
        )


def guarded(func: F) -> F:
    """Turn SpecError into exit 2 with its one line; never a traceback for user error."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except SpecError as err:
            fail(str(err))
        except KeyboardInterrupt:
            _console(stderr=True).print("interrupted")
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


# Every command names the file it writes -o / --output; `calibrate` said -O until 0.2: the old
# spelling is still read, unlisted, for one release.
OLD_OUTPUT = typer.Option(None, "-O", hidden=True)


def renamed_output(output: Any, old: Any) -> Any:
    """``old`` (-O, given) in place of ``output``, with a warning that the spelling goes."""
    if old is None:
        return output
    _console(stderr=True).print(
        "warning: -O is now -o / --output; -O goes in the next release", highlight=False
    )
    return old


def print_json(obj: Any) -> None:
    """One JSON document on stdout (NaN / inf become null so any parser reads it)."""
    sys.stdout.write(to_json(obj, indent=2) + "\n")
    sys.stdout.flush()
