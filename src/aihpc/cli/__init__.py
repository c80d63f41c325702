"""The aihpc command line. Thin: parse, call the library, render (rich) or print JSON.

Each area registers its commands from its own module; torch is imported only inside the
commands that need it, so ``aihpc estimate`` works without torch installed. ``main()`` imports
and registers only the area of the command it runs (``aihpc search`` does not load the
trainer's, the benchmarks' or the exporters' commands); ``aihpc`` alone, ``--help`` or an
unknown name get every command. ``aihpc.cli.app`` is the whole command tree.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import typer

from aihpc import __version__
from aihpc.cli._common import HelpGroup

__all__ = ["COMMAND_AREAS", "app", "build_app", "main"]

# (module, its registering function), in the order ``aihpc --help`` lists their commands.
_AREAS = (
    ("plan", "register"),
    ("validate", "register"),
    ("train", "register"),
    ("goodput", "register"),
    ("bench", "register"),
    ("calibrate", "register"),
    ("catalog", "register"),
    ("observe", "register"),
    ("interop", "register"),
    ("launch", "register"),
    ("rl", "register"),
    ("infer", "register"),
)
# The top-level commands each area registers (tests/cli/test_cli_areas.py checks it against
# the whole tree).
COMMAND_AREAS: dict[str, tuple[str, str]] = {
    **dict.fromkeys(("estimate", "search"), _AREAS[0]),
    "validate": _AREAS[1],
    "train": _AREAS[2],
    "goodput": _AREAS[3],
    "bench": _AREAS[4],
    "calibrate": _AREAS[5],
    **dict.fromkeys(("presets", "gpus"), _AREAS[6]),
    **dict.fromkeys(("doctor", "check", "dashboard"), _AREAS[7]),
    **dict.fromkeys(("import", "export"), _AREAS[8]),
    "launch": _AREAS[9],
    "rl": _AREAS[10],
    "infer": _AREAS[11],
}


def _version(value: bool) -> None:
    if value:
        typer.echo(f"aihpc {__version__}")
        raise typer.Exit()


def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """aihpc: plan (estimate, search, validate, goodput), run (train), measure (bench);
    presets and gpus list the names a run spec may use."""


def build_app(command: str | None = None) -> typer.Typer:
    """The command tree: every command, or only the area that registers ``command``."""
    tree = typer.Typer(
        name="aihpc",
        cls=HelpGroup,
        help="Plan, run, measure and recover large-model training on AI-HPC clusters.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    tree.callback()(_root)
    wanted = COMMAND_AREAS.get(command or "")
    for area in _AREAS:
        if wanted is None or area == wanted:
            module, register = area
            getattr(importlib.import_module(f"aihpc.cli.{module}"), register)(tree)
    return tree


def _command_of(argv: list[str]) -> str | None:
    """The command word when it comes first. A root option before it (``-h``, ``--version``)
    acts on the root, whose help must list every command."""
    return argv[0] if argv and not argv[0].startswith("-") else None


def __getattr__(name: str) -> Any:
    if name == "app":  # the whole tree, built once on first use
        tree = build_app()
        globals()["app"] = tree
        return tree
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _one_blas_thread() -> None:
    """The planner's numpy works element-wise on arrays of plans and never calls BLAS, whose
    OpenBLAS would start one thread per core when numpy loads (~40 ms of CPU on 2 cores, more
    on a login node with 64; issue 21 prices the whole ``aihpc search`` process). Set in this
    process's environment before numpy is imported; a value the user set is kept."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def main() -> None:
    command = _command_of(sys.argv[1:])
    if COMMAND_AREAS.get(command or "") in _AREAS[:2]:  # estimate, search, validate
        _one_blas_thread()
    build_app(command)()
