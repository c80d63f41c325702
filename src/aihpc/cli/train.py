"""``aihpc train RUN.toml --run-dir DIR``: the resilient trainer (torch imported lazily).

Three ways in, one command:

- a single process (no launcher): this process holds the run directory and trains;
- ``--nproc-per-node N``: this process holds the run directory and runs torchelastic's agent,
  whose workers are this same command (``AIHPC_ELASTIC_AGENT`` tells them so);
- under torchrun or srun: every rank runs this command; rank 0 takes the directory before any
  rank writes in it, and a refusal ends every rank with exit 2 (aihpc.runtime.ownership).

Every check that can fail on bad input runs before any worker starts, and a failure ends with
one line naming the cause as the last line (tracebacks go to ``DIR/logs/``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from aihpc.cli._common import RUNSPEC_HELP, console, fail, guarded, print_json, require_torch
from aihpc.cli.observe import metrics_args, metrics_config
from aihpc.runspec import RunSpec, SpecError, load_runspec

__all__ = ["register"]

MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week; beyond it timedelta and the watchdog lose meaning


def _render(summary: dict, finished_before: bool = False) -> None:
    loss = summary.get("final_loss")
    loss_text = f"{loss:.4f}" if isinstance(loss, float) else "n/a"
    if finished_before:
        console.print(
            f"[bold]already finished[/] at step {summary['final_step']} (summary.json kept): "
            f"final loss {loss_text}; raise training.train_steps to train on",
            highlight=False,
            soft_wrap=True,
        )
    else:
        console.print(
            f"[bold]trained[/] {summary['final_step']} steps on {summary['world_size']} rank(s): "
            f"final loss {loss_text}, restarts {summary['restarts']}, "
            + (
                f"requeues {summary.get('requeues', 0)}, "
                if summary.get("slurm_job_id") or summary.get("requeues")
                else ""
            )
            + (
                f"in-process restarts {summary['in_process_restarts']}, "
                if summary.get("in_process_restarts")
                else ""
            )
            + f"resumed from step {summary['resumed_from_step']}"
            + _tier_note(summary),
            highlight=False,
            soft_wrap=True,
        )
    perf = summary.get("performance") or {}
    if not finished_before and perf.get("measured_step_time_s"):
        console.print(_performance_line(perf), highlight=False, soft_wrap=True)
        if perf.get("imbalance"):  # a vision-language run: runtime/vlm/summary.py
            console.print(_imbalance_line(perf["imbalance"]), highlight=False, soft_wrap=True)
    console.print(f"state_sha256 {summary['state_sha256']}", highlight=False, soft_wrap=True)


def _tier_note(summary: dict) -> str:
    """Which tier served the load the run continued from (aihpc.runtime.recoveries)."""
    tier = (summary.get("resumed_from") or {}).get("tier")
    notes = {"memory": " (from memory)", "peer": " (from a peer's memory)", "storage": ""}
    return notes.get(tier, "")


def _performance_line(perf: dict) -> str:
    """Measured step time beside the prediction for the machine the run ran on, or the reason
    there is none (a CPU run of an H100 spec read "-100%")."""
    measured = (
        f"step time {perf['measured_step_time_s'] * 1e3:.1f} ms measured (median of "
        f"{perf['measured_steps']})"
    )
    if not perf.get("predicted_step_time_s"):
        return f"{measured}; {perf.get('no_prediction') or 'no prediction'}"
    return (
        f"{measured}, {perf['predicted_step_time_s'] * 1e3:.1f} ms predicted by aihpc estimate "
        f"on {perf.get('prediction_for') or 'the spec'} ({perf['step_time_error']:+.0%}); MFU "
        f"{perf['measured_mfu']:.1%} measured, {perf['predicted_mfu']:.1%} predicted (both "
        "over its GPU peak)"
    )


def _imbalance_line(imb: dict) -> str:
    """A VLM run's encoder: predicted (fwd + bwd, and the slowest rank's excess) beside the
    measured forward and the images the ranks encoded."""
    m = imb.get("measured") or {}
    line = "encoder"
    if imb.get("predicted_encoder_s") is not None:
        line += (
            f" {imb['predicted_encoder_s'] * 1e3:.1f} ms + imbalance "
            f"{imb['predicted_encoder_imbalance_s'] * 1e3:.2f} ms predicted (forward + backward);"
        )
    if not m:
        return line + " not measured"
    fwd = imb.get("predicted_encoder_forward_s")
    beside = f" ({fwd * 1e3:.1f} ms predicted)" if fwd is not None else ""
    return (
        f"{line} forward {m['encoder_forward_s_mean'] * 1e3:.1f} ms measured{beside}, slowest rank "
        f"+{m['encoder_forward_imbalance_s'] * 1e3:.2f} ms; images per rank and step "
        f"{m['images_per_rank_mean']:.1f} mean, {m['images_per_rank_max']:.1f} on the busiest"
    )


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


def _check_timeout(flag: str, value: float) -> None:
    if not 0 < value <= MAX_TIMEOUT_S:
        raise SpecError(flag, value, f"seconds in (0, {MAX_TIMEOUT_S:.0f}] (a week)")


def _check_faults(spec: RunSpec, texts: list[str], world: int | None) -> tuple:
    """Parse ``--inject``; refuse a fault that could never fire in this run (the rank check
    once the world size is known)."""
    from aihpc.resilience import parse_fault

    faults = tuple(parse_fault(f) for f in texts)
    last, every = spec.training.train_steps, spec.checkpoint.interval_steps
    for text, fault in zip(texts, faults, strict=True):
        if world is not None and fault.rank >= world:
            raise SpecError("--inject", text, f"rank must be below world size {world}")
        if fault.at in ("step", "save", "fs") and fault.step > last:
            raise SpecError("--inject", text, f"step must be at most training.train_steps {last}")
        saves = fault.at in ("save", "fs") or fault.kind == "corrupt-checkpoint"
        if saves and fault.step % every and fault.step != last:
            raise SpecError(
                "--inject",
                text,
                f"acts on a checkpoint, so step must be a multiple of checkpoint.interval_steps "
                f"{every} or the last step {last}",
            )
    return faults


def _check_host_memory(spec: RunSpec, local_ranks: int) -> None:
    """On a CPU host, refuse a plan whose per-rank memory (as ``aihpc estimate`` prices it)
    times the ranks on this host exceeds the memory available, before anything is allocated."""
    import torch

    from aihpc.perf.step.batch_memory import memory_breakdown
    from aihpc.perf.step.memory import GiB

    if torch.cuda.is_available():
        return
    try:
        meminfo = Path("/proc/meminfo").read_text().split("MemAvailable:")[1]
        available = int(meminfo.split()[0]) * 1024
    except (OSError, IndexError, ValueError):
        return
    per_rank = memory_breakdown(spec.model, spec.cluster, spec.plan(), spec.training).total
    if per_rank * local_ranks > available:
        raise SpecError(
            "model",
            spec.model.name,
            f"needs {per_rank / GiB:.1f} GiB per rank x {local_ranks} rank(s) on this host "
            f"(aihpc estimate's memory), but {available / GiB:.1f} GiB is available",
        )


def _prepare_run_dir(
    run_dir: Path, spec: RunSpec, data: Path | None, tokenizer: str | None = None
) -> dict | None:
    """Before any worker starts: refuse a checkpoint written by another run spec; return the
    summary of a run that already finished every step (it is then left as it is)."""
    from aihpc.resilience.manifest import (
        CheckpointCorruptError,
        check_identity,
        committed_checkpoints,
    )
    from aihpc.runtime.rundir import finished_summary, repair_logs, run_identity

    # the newest checkpoint whose manifest can be read: one that cannot is fallen back past
    for info in reversed(committed_checkpoints(run_dir / "checkpoints")[0]):
        with contextlib.suppress(CheckpointCorruptError):
            check_identity(info.path, run_identity(spec, data, tokenizer))
            break
    for note in repair_logs(run_dir):
        logging.getLogger("aihpc.runtime").warning("%s", note)
    return finished_summary(run_dir, spec)


def _worker_line(err: BaseException, rank: int, run_dir: Path) -> str:
    from aihpc.runtime.rundir import ERROR_LOG_ATTR, write_error_log

    path = getattr(err, ERROR_LOG_ATTR, None)  # the trainer wrote it before the teardown
    if path is None:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        path = write_error_log(run_dir, rank, attempt, err)
    first = (str(err).strip().splitlines() or [""])[0][:300]
    return f"rank {rank}: {type(err).__name__}: {first} (traceback in {path})"


TRAIN_DATA = typer.Option(
    None,
    "--data",
    help="UTF-8 text, a .jsonl / .parquet dataset (its text field), or pre-tokenized "
    ".npy (default: shipped sample).",
)
TRAIN_TOKENIZER = typer.Option(
    None,
    "--tokenizer",
    help="A Hugging Face tokenizer.json (or its folder), or 'sample' (a shipped 512-id "
    "BPE); default: bytes.",
)


def _check_launch_flags(data: Path | None, nproc_per_node: int | None, max_restarts: int) -> None:
    """--data, --nproc-per-node and --max-restarts, before anything imports torch."""
    if data is not None and not data.is_file():
        what = "is a directory" if data.is_dir() else "file not found"
        allowed = "expected UTF-8 text, a .jsonl / .parquet dataset or a .npy token array"
        raise SpecError("--data", str(data), f"{what}; {allowed}")
    if nproc_per_node is not None and nproc_per_node < 1:
        raise SpecError("--nproc-per-node", nproc_per_node, "a positive integer")
    if max_restarts < 0:
        raise SpecError("--max-restarts", max_restarts, "an integer >= 0")


def register(app: typer.Typer) -> None:
    @app.command()
    @guarded
    def train(
        runspec: Path = typer.Argument(..., help=RUNSPEC_HELP),
        run_dir: Path = typer.Option(..., "--run-dir", help="Checkpoints, metrics and summary."),
        data: Path | None = TRAIN_DATA,
        tokenizer: str | None = TRAIN_TOKENIZER,
        nproc_per_node: int | None = typer.Option(
            None, "--nproc-per-node", help="Start torchrun's elastic agent with N workers."
        ),
        max_restarts: int = typer.Option(
            0, "--max-restarts", help="Restarts of the worker group on failure."
        ),
        inject: list[str] | None = typer.Option(
            None,
            "--inject",
            help="Fault, kind:step=N[:rank=R][:at=step|save|start|load|final|fs][:op=K]"
            "[:mode=...], kind one of kill, hang, exception, corrupt-checkpoint (repeatable).",
        ),
        hang_timeout: float = typer.Option(
            300.0, "--hang-timeout", help="Seconds without progress before teardown."
        ),
        startup_timeout: float = typer.Option(
            600.0, "--startup-timeout", help="Bound on start-up and the first step, seconds."
        ),
        metrics_port: int | None = typer.Option(
            None, "--metrics-port", help="Prometheus endpoint: rank r serves on P + local rank."
        ),
        metrics_host: str = typer.Option(
            "127.0.0.1",
            "--metrics-host",
            help="Address the endpoint listens on (0.0.0.0: every interface, for a remote "
            "Prometheus).",
        ),
        metrics_textfile: Path | None = typer.Option(
            None, "--metrics-textfile", help="Folder for node-exporter's textfile collector."
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    ) -> None:
        """Train the run spec's model under its plan (DP / FSDP / HSDP, TP + SP, PP, CP, EP
        for MoE experts), checkpointing and resuming exactly."""
        # Flags first, without torch (a second at most), then what needs the runtime.
        spec = load_runspec(runspec)
        _check_launch_flags(data, nproc_per_node, max_restarts)
        _check_timeout("--hang-timeout", hang_timeout)
        _check_timeout("--startup-timeout", startup_timeout)
        inject = inject or []
        _check_faults(spec, inject, None)
        require_torch("train")
        from aihpc.runtime import check_trainable, launcher_env

        env = launcher_env()
        agent = env is None and nproc_per_node is not None
        world = int(env["WORLD_SIZE"]) if env else (nproc_per_node if agent else 1)
        check_trainable(spec, world, data, tokenizer)
        faults = _check_faults(spec, inject, world)
        metrics = metrics_config(metrics_port, metrics_textfile, nproc_per_node or 1, metrics_host)
        if env is None:
            _check_host_memory(spec, world)
        _check_run_dir(run_dir)
        job = _Job(
            spec, runspec, run_dir, data, faults, inject, hang_timeout, startup_timeout, metrics,
            tokenizer,
        )  # fmt: skip
        if env is None:
            job.own(agent, nproc_per_node, max_restarts, as_json)
        else:
            job.work(int(env["RANK"]), as_json)


@dataclass(frozen=True)
class _Job:
    """One ``aihpc train`` invocation, validated; ``own`` or ``work`` runs it."""

    spec: RunSpec
    runspec: Path
    run_dir: Path
    data: Path | None
    faults: tuple[Any, ...]
    inject: list[str]
    hang_timeout: float
    startup_timeout: float
    metrics: Any  # aihpc.observe.metrics.MetricsConfig | None
    tokenizer: str | None = None

    def options(self, **kw: Any) -> Any:
        from aihpc.runtime import TrainOptions

        return TrainOptions(
            run_dir=self.run_dir,
            data=self.data,
            tokenizer=self.tokenizer,
            faults=self.faults,
            hang_timeout_s=self.hang_timeout,
            startup_timeout_s=self.startup_timeout,
            progress=True,
            metrics=self.metrics,
            **kw,
        )

    def own(self, agent: bool, nproc: int | None, max_restarts: int, as_json: bool) -> None:
        """This process owns the job: hold the run directory, check it, then train here or
        under the elastic agent."""
        from aihpc.resilience import RunDirBusyError, RunDirLock

        _log_setup(0)
        try:
            lock = RunDirLock(self.run_dir).acquire()
        except RunDirBusyError as err:
            raise SpecError("--run-dir", str(self.run_dir), err.describe()) from None
        with lock:
            done = _prepare_run_dir(self.run_dir, self.spec, self.data, self.tokenizer)
            if done is not None:
                print_json(done) if as_json else _render(done, finished_before=True)
                return
            if agent:
                summary = self._agent(nproc or 1, max_restarts)
            else:
                summary = self._train(0, lock_held=True)
        print_json(summary) if as_json else _render(summary)
        sys.stdout.flush()

    def work(self, rank: int, as_json: bool) -> None:
        """This process is one rank of a job a launcher started."""
        from aihpc.resilience import die_with_parent

        _log_setup(rank)
        agent_pid = os.environ.get("AIHPC_AGENT_PID")
        parent = int(agent_pid) if agent_pid else os.getppid()
        die_with_parent(parent)  # the launcher's death ends this rank at once
        summary = self._train(rank, lock_held=bool(agent_pid), watch_parent=parent)
        if rank != 0 or agent_pid:
            return  # under our own agent, the agent prints the summary
        print_json(summary) if as_json else _render(summary)
        sys.stdout.flush()

    def _train(self, rank: int, **kw: Any) -> dict:
        """Train in this process; an unexpected error ends it with one line (exit 1) naming
        the cause, its traceback written to the run directory's logs."""
        from aihpc.runtime import run as run_training

        # The process group's own timeout stays above the watchdog's bounds: the watchdog,
        # not gloo, decides that a rank hangs.
        timeout_s = max(self.startup_timeout, 4 * self.hang_timeout)
        try:
            return run_training(self.spec, self.options(**kw), timeout_s=timeout_s)
        except SpecError as err:
            if getattr(err, "quiet", False):  # refused run dir: rank 0 says it, once per job
                raise typer.Exit(2) from None
            raise
        except KeyboardInterrupt:
            raise
        except Exception as err:
            fail(_worker_line(err, rank, self.run_dir), code=1)
            raise AssertionError("fail() exits") from err

    def _agent(self, nproc: int, max_restarts: int) -> dict:
        from aihpc.runtime.launch import launch_elastic

        args = ["train", str(self.runspec), "--run-dir", str(self.run_dir)]
        args += ["--hang-timeout", str(self.hang_timeout)]
        args += ["--startup-timeout", str(self.startup_timeout)]
        if self.data is not None:
            args += ["--data", str(self.data)]
        if self.tokenizer is not None:
            args += ["--tokenizer", self.tokenizer]
        for f in self.inject:
            args += ["--inject", f]
        args += metrics_args(self.metrics)
        code, line = launch_elastic(nproc, max_restarts, args, self.run_dir)
        if code:
            fail(line, code=code)
        return json.loads((self.run_dir / "summary.json").read_text())


def _log_setup(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format=f"[%(name)s rank {rank}] %(message)s"
    )
