"""``aihpc train RUN.toml --run-dir DIR``: the resilient trainer (torch imported lazily)."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import typer

from aihpc.cli._common import console, guarded, print_json
from aihpc.cli.observe import metrics_args, metrics_config  # observe
from aihpc.spec import SpecError, load_runspec

__all__ = ["register"]


def _render(summary: dict) -> None:
    console.print(
        f"[bold]trained[/] {summary['final_step']} steps on {summary['world_size']} rank(s): "
        f"final loss {summary['final_loss']:.4f}, restarts {summary['restarts']}, "
        f"resumed from step {summary['resumed_from_step']}",
        highlight=False,
        soft_wrap=True,
    )
    console.print(f"state_sha256 {summary['state_sha256']}", highlight=False, soft_wrap=True)


def _check_run_dir(run_dir: Path) -> None:
    """The run directory must be (or become) a writable folder, before any process starts."""
    if run_dir.exists() and not run_dir.is_dir():
        raise SpecError("--run-dir", str(run_dir), "exists and is not a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SpecError("--run-dir", str(run_dir), f"cannot be created ({err.strerror})") from err
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise SpecError("--run-dir", str(run_dir), "is not writable")


def register(app: typer.Typer) -> None:
    @app.command()
    @guarded
    def train(
        runspec: Path = typer.Argument(..., help="Run spec (TOML)."),
        run_dir: Path = typer.Option(..., "--run-dir", help="Checkpoints, metrics and summary."),
        data: Path | None = typer.Option(
            None, "--data", help="UTF-8 text, or pre-tokenized .npy (default: shipped sample)."
        ),
        nproc_per_node: int | None = typer.Option(
            None, "--nproc-per-node", help="Start torchrun's elastic agent with N workers."
        ),
        max_restarts: int = typer.Option(
            0, "--max-restarts", help="Restarts of the worker group on failure."
        ),
        inject: list[str] | None = typer.Option(
            None, "--inject", help="Fault, e.g. kill:step=17:rank=1 (repeatable)."
        ),
        hang_timeout: float = typer.Option(
            300.0, "--hang-timeout", help="Seconds without progress before teardown."
        ),
        metrics_port: int | None = typer.Option(  # observe
            None, "--metrics-port", help="Prometheus endpoint: rank r serves on P + local rank."
        ),
        metrics_textfile: Path | None = typer.Option(  # observe
            None, "--metrics-textfile", help="Folder for node-exporter's textfile collector."
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    ) -> None:
        """Train the run spec's model (DDP / FSDP2), checkpointing and resuming exactly."""
        from aihpc.resilience import parse_fault
        from aihpc.runtime import TrainOptions, check_trainable, launcher_env
        from aihpc.runtime import run as run_training
        from aihpc.runtime.launch import launch_elastic

        faults = tuple(parse_fault(f) for f in inject or [])
        spec = load_runspec(runspec)
        if data is not None and not data.is_file():
            what = "is a directory" if data.is_dir() else "file not found"
            allowed = "expected UTF-8 text or a .npy token array"
            raise SpecError("--data", str(data), f"{what}; {allowed}")
        if nproc_per_node is not None and nproc_per_node < 1:
            raise SpecError("--nproc-per-node", nproc_per_node, "a positive integer")
        if max_restarts < 0:
            raise SpecError("--max-restarts", max_restarts, "an integer >= 0")
        if not hang_timeout > 0:
            raise SpecError("--hang-timeout", hang_timeout, "seconds > 0")
        env = launcher_env()
        agent = env is None and nproc_per_node is not None
        world = int(env["WORLD_SIZE"]) if env else (nproc_per_node if agent else 1)
        check_trainable(spec, world, data)
        metrics = metrics_config(metrics_port, metrics_textfile, nproc_per_node or 1)  # observe
        for text, fault in zip(inject or [], faults, strict=True):
            if fault.rank >= world:
                raise SpecError("--inject", text, f"rank must be below world size {world}")
        _check_run_dir(run_dir)

        if agent:
            args = [
                "train",
                str(runspec),
                "--run-dir",
                str(run_dir),
                "--hang-timeout",
                str(hang_timeout),
            ]
            if data is not None:
                args += ["--data", str(data)]
            for f in inject or []:
                args += ["--inject", f]
            args += metrics_args(metrics)  # observe
            code = launch_elastic(nproc_per_node, max_restarts, args)
            if code:
                raise typer.Exit(code)
            summary = json.loads((run_dir / "summary.json").read_text())
        else:
            rank = int(env["RANK"]) if env else 0
            logging.basicConfig(
                level=logging.INFO, stream=sys.stderr, format=f"[%(name)s rank {rank}] %(message)s"
            )
            opts = TrainOptions(
                run_dir=run_dir,
                data=data,
                faults=faults,
                hang_timeout_s=hang_timeout,
                progress=True,
                metrics=metrics,  # observe
            )
            summary = run_training(spec, opts, timeout_s=max(600.0, 4 * hang_timeout))
            if rank != 0 or os.environ.get("AIHPC_ELASTIC_AGENT"):
                return  # under our own agent, the agent prints the summary
        if as_json:
            print_json(summary)
        else:
            _render(summary)
        sys.stdout.flush()
