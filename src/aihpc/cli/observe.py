"""Observing commands: ``aihpc doctor``, ``aihpc check``, ``aihpc dashboard``, and the
``--metrics-*`` options of ``aihpc train`` (torch imported inside ``check`` only)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import typer

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
    """``doctor``, ``check`` and ``dashboard`` (added by their modules below)."""
