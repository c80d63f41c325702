"""What the distributed bench commands share (``aihpc bench comm``, ``aihpc bench moe``): their
common options, the progress bar, the launch (here under torchrun / srun, or spawned local
workers) and how rank 0 publishes the result."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

from aihpc._io import check_output_path, to_json, write_atomic
from aihpc.cli._common import err_console, fail, print_json
from aihpc.runspec.errors import SpecError

__all__ = [
    "AS_JSON",
    "CHECK",
    "NPROC_PER_NODE",
    "OUTPUT",
    "RANKS_PER_NODE",
    "TIMEOUT",
    "launch_plan",
    "progress",
    "publish",
    "run_workers",
]


@contextlib.contextmanager
def progress(total: int, enabled: bool) -> Iterator[Any]:
    """A rich progress bar on stderr (None when disabled: --json, not rank 0, or no terminal)."""
    if not enabled or not err_console.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        console=err_console,
        transient=True,
        redirect_stdout=sys.stdout.isatty(),
    ) as progress:
        progress.add_task("bench", total=total)
        yield progress


def publish(doc: dict[str, Any], lead: bool, as_json: bool, output: str | None) -> dict:
    """Rank 0 prints the JSON (--json) and writes it (--output); every rank returns the status
    the launcher turns into an exit code."""
    if lead:
        if as_json:
            print_json(doc)
        if output:
            write_atomic(Path(output), to_json(doc, indent=2) + "\n")
    return {"wrong_rows": doc["wrong_rows"]}


# options every distributed bench command takes (comm, moe)
CHECK = typer.Option(1, "-c", "--check", help="1: count wrong elements; 0: off.")
RANKS_PER_NODE = typer.Option(
    None, "--ranks-per-node", help="Override the node split (default: by hostname)."
)
NPROC_PER_NODE = typer.Option(
    None,
    "--nproc-per-node",
    help="Start N local workers (default: one per local GPU, or 2 on CPU; "
    "not used under torchrun / srun).",
)
TIMEOUT = typer.Option(300.0, "--timeout", help="Process-group timeout, s.")
OUTPUT = typer.Option(None, "-o", "--output", help="Also write the JSON here.")
# nccl-tests' -o is the reduction: a run typing it would name the JSON file after one
NCCL_TESTS_OPS = ("sum", "prod", "max", "min", "avg", "all")
AS_JSON = typer.Option(False, "--json", help="Print one JSON object.")


def launch_plan(
    check: int, output: str | None, nproc_per_node: int | None
) -> tuple[dict[str, str] | None, int]:
    """Check the options every distributed bench takes; (launcher env or None, world size).

    A collective on one rank measures nothing: without a launcher the default is every local
    GPU, or 2 processes on a CPU."""
    if check not in (0, 1):
        raise SpecError("-c/--check", check, "allowed: 0 | 1")
    if output in NCCL_TESTS_OPS:
        raise SpecError("-o/--output", output, "a file for the JSON (nccl-tests' -o is --op here)")
    if output:
        check_output_path(Path(output), "--output")
    if nproc_per_node is not None and nproc_per_node < 1:
        raise SpecError("--nproc-per-node", nproc_per_node, "must be >= 1")
    import torch

    from aihpc.bench.dist import launcher_env

    env = launcher_env()
    if env is None and nproc_per_node is None:
        nproc_per_node = torch.cuda.device_count() if torch.cuda.is_available() else 2
    return env, int(env["WORLD_SIZE"]) if env else (nproc_per_node or 1)


def run_workers(
    worker: Any, env: dict[str, str] | None, world: int, args: tuple, unit: str
) -> None:
    """Run ``worker(*args)`` here (under torchrun / srun) or in ``world`` spawned local workers;
    turn a worker's SpecError into exit 2 and wrong results into exit 1 (one line each)."""
    from aihpc.bench.dist import launch_local

    if env is not None:
        status = worker(*args)
    else:
        import torch.multiprocessing as tmp

        try:
            status = launch_local(world, worker, *args)
        except (tmp.ProcessRaisedException, tmp.ProcessExitedException) as err:
            last = [ln for ln in str(err).strip().splitlines() if ln.strip()]
            fail(f"a benchmark worker failed: {last[-1] if last else err}", code=1)
    if status and "spec_error" in status:
        raise SpecError(*status["spec_error"])
    if status and status.get("wrong_rows"):
        fail(f"{status['wrong_rows']} {unit} returned wrong elements (#wrong > 0)", code=1)
