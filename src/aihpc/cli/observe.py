"""Observing commands: ``aihpc doctor``, ``aihpc check``, ``aihpc dashboard``, and the
``--metrics-*`` options of ``aihpc train`` (torch imported inside ``check`` only)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import typer

from aihpc.cli._common import guarded, print_json
from aihpc.observe.metrics import MetricsConfig
from aihpc.spec.errors import SpecError

__all__ = ["metrics_args", "metrics_config", "register"]


def metrics_config(
    port: int | None, textfile: Path | None, local_procs: int
) -> MetricsConfig | None:
    """Validate ``aihpc train``'s ``--metrics-port`` / ``--metrics-textfile`` before any process
    starts. Ranks on a node listen on ``port .. port + local_procs - 1``."""
    if port is None and textfile is None:
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", local_procs))
    if port is not None:
        if not 1 <= port <= 65536 - local:
            raise SpecError(
                "--metrics-port", port, f"a TCP port in 1..{65536 - local} ({local} rank(s) here)"
            )
        if "LOCAL_RANK" not in os.environ:  # the launching process: check the whole range now
            for p in range(port, port + local):
                _check_free(p)
    if textfile is not None:
        if textfile.exists() and not textfile.is_dir():
            raise SpecError("--metrics-textfile", str(textfile), "exists and is not a folder")
        try:
            textfile.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise SpecError(
                "--metrics-textfile", str(textfile), f"cannot be created ({err.strerror})"
            ) from None
        if not os.access(textfile, os.W_OK | os.X_OK):
            raise SpecError("--metrics-textfile", str(textfile), "is not writable")
    return MetricsConfig(port=port, textfile_dir=textfile)


def _check_free(port: int) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError as err:
            raise SpecError(
                "--metrics-port", port, f"cannot listen there ({err.strerror}); pick a free port"
            ) from None


def metrics_args(config: MetricsConfig | None) -> list[str]:
    """The same options for the workers that the elastic agent starts."""
    if config is None:
        return []
    args: list[str] = []
    if config.port is not None:
        args += ["--metrics-port", str(config.port)]
    if config.textfile_dir is not None:
        args += ["--metrics-textfile", str(config.textfile_dir)]
    return args


def register(app: typer.Typer) -> None:
    """``doctor``, ``check`` and ``dashboard``."""
    _register_doctor(app)


def _render_diagnosis(d: Any) -> None:
    from rich.table import Table

    from aihpc.cli._common import console

    style = "bold red" if d.cause is not None else "bold green"
    console.print(f"[{style}]{d.summary}[/]", highlight=False, soft_wrap=True)
    if d.cause is not None:
        e = d.cause
        console.print(
            f"first failure: {e.where()}, {Path(e.file).name}:{e.line}"
            + (f", {_clock(e.time)}" if e.time else ""),
            highlight=False,
            soft_wrap=True,
        )
        console.print(f"  {e.text}", style="dim", highlight=False, soft_wrap=True, markup=False)
    for s in d.stuck:
        console.print(f"flight recorder: {s.describe()}", highlight=False, soft_wrap=True)
    if d.follow_on:
        table = Table(title="failures it caused (follow-on)", title_justify="left")
        for col in ("rank", "node", "what", "lines"):
            table.add_column(col)
        for row in d.follow_on[:12]:
            what = ", ".join(f"{k} x{v}" for k, v in row["classes"].items())
            table.add_row(
                "-" if row["rank"] is None else str(row["rank"]),
                row["node"] or "-",
                what,
                str(sum(row["classes"].values())),
            )
        if len(d.follow_on) > 12:
            table.add_row("...", "", f"{len(d.follow_on) - 12} more", "")
        console.print(table)
    console.print(f"[bold]action:[/] {d.action}", highlight=False, soft_wrap=True, markup=True)
    console.print(
        f"read {d.files} file(s), {d.lines:,} lines; ranks seen: {_span(d.ranks_seen)}",
        style="dim",
        highlight=False,
    )


def _clock(t: float) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _span(ranks: list[int]) -> str:
    if not ranks:
        return "none"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def _register_doctor(app: typer.Typer) -> None:
    @app.command()
    @guarded
    def doctor(
        logs: list[Path] = typer.Argument(
            ..., help="Log files or folders: ranks' output, dmesg, events.jsonl, FR dumps."
        ),
        spec: Path | None = typer.Option(
            None, "--spec", help="The run spec: an OOM is set against its estimated memory."
        ),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    ) -> None:
        """Find the first failure in a failed or hung job's logs, what it caused, what to do."""
        from aihpc.observe.doctor import diagnose
        from aihpc.spec import load_runspec

        for p in logs:
            if not p.exists():
                raise SpecError("LOG", str(p), "no such file or folder")
        run_spec = load_runspec(spec) if spec is not None else None
        diagnosis = diagnose(list(logs), run_spec)
        if as_json:
            print_json(diagnosis.to_json())
        else:
            _render_diagnosis(diagnosis)
