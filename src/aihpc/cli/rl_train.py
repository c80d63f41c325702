"""``aihpc rl train RUN.toml --run-dir DIR``: GRPO run for real on the trainer's model
(aihpc.runtime.rl), rollout with the KV cache colocated or in worker processes of its own
(disaggregated, optionally asynchronous), on the shipped arithmetic task."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import typer

from aihpc.cli._common import guarded, print_json
from aihpc.runspec import SpecError, load_runspec

__all__ = ["register_train"]


def register_train(rl_app: typer.Typer) -> None:
    @rl_app.command("train")
    @guarded
    def train(
        runspec: Path = typer.Argument(..., help="Run spec TOML with an [rl] table."),
        run_dir: Path = typer.Option(..., "--run-dir", help="Metrics, checkpoints, summary."),
        nproc_per_node: int = typer.Option(1, "--nproc-per-node", help="Ranks (gloo on CPU)."),
        sft_steps: int = typer.Option(0, "--sft-steps", help="Supervised warm-up steps."),
        kl_coef: float = typer.Option(0.04, "--kl-coef", help="KL to the reference (beta)."),
        clip: float = typer.Option(0.2, "--clip", help="Policy-ratio clip range."),
        temperature: float = typer.Option(1.0, "--temperature", help="Rollout sampling."),
        task_base: int = typer.Option(20, "--task-base", help="Operands in [0, base)."),
        inject: list[str] | None = typer.Option(
            None,
            "--inject",
            help="A drill's fault after a GRPO step: kill|exception|hang:step=N"
            "[:rank=R][:mode=node|stop|stall] (repeatable; each fires once per run directory).",
        ),
        hang_timeout: float = typer.Option(
            300.0, "--hang-timeout", help="Seconds a GRPO step may go without progress."
        ),
        startup_timeout: float = typer.Option(
            600.0, "--startup-timeout", help="Bound on start-up, the warm-up and evaluations."
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    ) -> None:
        """GRPO: rollout (KV cache), exact-match rewards, group-relative advantages, clipped
        loss with KL, update under the [parallel] plan (DDP / FSDP / TP / PP), weights synced in
        place (colocated) or broadcast to rollout worker processes (disaggregated,
        rl.staleness); in-memory snapshots and in-process restart ([checkpoint])."""
        from aihpc.cli.train import _check_timeout
        from aihpc.runtime.rl.run import RunOptions, check_rl_run, grpo_config

        if nproc_per_node < 1:
            raise SpecError("--nproc-per-node", nproc_per_node, "must be >= 1")
        _check_timeout("--hang-timeout", hang_timeout)
        _check_timeout("--startup-timeout", startup_timeout)
        spec = load_runspec(runspec)
        world = int(os.environ.get("WORLD_SIZE", nproc_per_node))
        opts = RunOptions(
            sft_steps=sft_steps, clip=clip, kl_coef=kl_coef, temperature=temperature,
            task_base=task_base, faults=_faults(spec, inject or [], world),
            hang_timeout_s=hang_timeout, startup_timeout_s=startup_timeout,
        )  # fmt: skip
        check_rl_run(spec, world, opts)  # every refusal before a process starts
        grpo_config(spec, opts)
        if run_dir.exists() and not run_dir.is_dir():
            raise SpecError("--run-dir", str(run_dir), "exists and is not a directory")
        run_dir.mkdir(parents=True, exist_ok=True)
        if nproc_per_node > 1 and "RANK" not in os.environ:
            _torchrun(nproc_per_node, as_json)
            return
        summary = _run(spec, run_dir, opts, as_json)
        if os.environ.get("RANK", "0") != "0":
            return
        if as_json:
            print_json(summary)
        else:
            typer.echo(_summary_line(summary))


def _faults(spec: Any, texts: list[str], world: int) -> tuple:
    """``--inject``: the faults the RL loop fires (after a step), each able to fire here."""
    from aihpc.resilience import parse_fault

    faults = tuple(parse_fault(t) for t in texts)
    for text, f in zip(texts, faults, strict=True):
        if f.kind not in ("kill", "exception", "hang") or f.at != "step":
            raise SpecError("--inject", text, "aihpc rl train fires kill | exception | hang "
                            "at=step (after a GRPO step and its checkpoint)")  # fmt: skip
        last = spec.training.train_steps
        if f.rank >= world or f.step > last:
            raise SpecError("--inject", text, f"rank must be below the {world} ranks and step "
                            f"at most training.train_steps {last}")  # fmt: skip
    return faults


def _run(spec: Any, run_dir: Path, opts: Any, as_json: bool) -> dict:
    from aihpc.runtime.rl.run import run_rl

    def echo(m: dict) -> None:
        typer.echo(
            f"step {m['step']:>4}  reward {m['reward']:.3f}  kl {m['kl']:.4f}  "
            f"len {m['response_len']:.2f}  rollout {m['rollout_s'] * 1e3:.0f} ms  "
            f"update {m['update_s'] * 1e3:.0f} ms  sync {m['weight_sync_s'] * 1e3:.1f} ms"
        )

    return run_rl(spec, run_dir, opts, None if as_json else echo)


def _torchrun(nproc: int, as_json: bool) -> None:
    """The same command under torchrun, one rank per process (rank 0 prints)."""
    from aihpc.runtime.distributed import free_port

    # the same arguments: each rank sees RANK set and runs instead of starting ranks
    args = sys.argv[1:]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", "-m", "aihpc", *args]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    done = subprocess.run(cmd, env=env, check=False)
    if done.returncode:
        raise typer.Exit(done.returncode)


def _summary_line(s: dict) -> str:
    return (
        f"{s['steps']} GRPO steps on {s['world_size']} rank(s): held-out exact-answer accuracy "
        f"{s['accuracy_before']:.3f} -> {s['accuracy_after']:.3f} "
        f"({s['heldout_prompts']} prompts)"
    )
