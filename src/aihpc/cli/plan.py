"""Planning commands: estimate, search, validate."""

from __future__ import annotations

import typer

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    """Filled in by the performance-model work."""
