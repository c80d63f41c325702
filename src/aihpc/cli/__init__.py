"""The aihpc command line. Thin: parse, call the library, render (rich) or print JSON.

Each area registers its commands from its own module; torch is imported only inside the
commands that need it, so ``aihpc estimate`` works without torch installed.
"""

from __future__ import annotations

import typer

from aihpc import __version__
from aihpc.cli import bench, catalog, goodput, interop, observe, plan, train
from aihpc.cli._common import HelpGroup

__all__ = ["app", "main"]

app = typer.Typer(
    name="aihpc",
    cls=HelpGroup,
    help="Plan, run, measure and recover large-model training on AI-HPC clusters.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"aihpc {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """aihpc: plan (estimate, search, validate, goodput), run (train), measure (bench);
    presets and gpus list the names a run spec may use."""


plan.register(app)
train.register(app)
goodput.register(app)
bench.register(app)
catalog.register(app)
observe.register(app)
interop.register(app)
interop.register_launch(app)


def main() -> None:
    app()
