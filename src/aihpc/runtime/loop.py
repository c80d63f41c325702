"""The training loop of one launch: a step, its metrics line and Prometheus figures, the
watchdog's beat, checkpoints (storage and the in-memory tier) at their intervals, an agreed
preemption (save, then exit), and the faults a drill injects; with a progress bar on a terminal.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, NoReturn

import torch

from aihpc._io import to_json
from aihpc.resilience.preempt import Preempted, PreemptWatch
from aihpc.runtime.job import Job
from aihpc.runtime.rundir import logged_loss

__all__ = ["checkpoint", "progress_bar", "run_loop", "snapshot"]


@contextmanager
def progress_bar(
    enabled: bool, total: int, done: int
) -> Iterator[Callable[[int, str, bool], None]]:
    """Yield ``report(step, info, log)``: a rich bar on a terminal; ``log`` lines always (through
    the bar's console, so they print above the bar instead of through it)."""
    if not enabled:
        yield lambda step, info, log: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True, highlight=False, soft_wrap=True)
    with Progress(
        TextColumn("train"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
        console=console,
        disable=not console.is_terminal,
    ) as bar:
        task = bar.add_task("train", total=total, completed=done, info="")

        def report(step: int, info: str, log: bool) -> None:
            bar.update(task, completed=step, info=info)
            if log:
                console.print(f"step {step}/{total}  {info}", markup=False)

        yield report


def checkpoint(job: Job, step: int, loss: float | None = None) -> None:
    """Save at ``step`` under the save phase's bound, then fire the faults due after it. The
    step's ``loss`` goes into the event too: the record of it should metrics.jsonl be lost."""
    manager, injector, events = job.manager, job.injector, job.events
    job.watchdog.phase("save", job.bounds.save(manager.last_state_bytes or job.state_bytes_guess))
    injector.arm_fs(step, manager.root)
    manager.save(step, job.state)
    exact = {"loss_hex": loss.hex()} if loss is not None else {}
    events("checkpoint_saved", step=step, blocking_s=manager.last_blocking_s, **exact)
    job.observe.checkpoint(step, manager.last_blocking_s, manager.root / f"step_{step:08d}")
    job.watchdog.beat(step)
    if injector.due(step, "step", ("corrupt-checkpoint",)):
        manager.wait()
        bad = injector.corrupt(step, manager.root / f"step_{step:08d}")
        events("fault_corrupt", step=step, file=str(bad))


def snapshot(job: Job, step: int) -> None:
    job.watchdog.phase("save", job.bounds.save(job.memory.own_bytes or job.state_bytes_guess))
    kept = job.memory.snapshot(step, job.state)
    job.events(
        "memory_snapshot",
        step=step,
        kept=kept,
        seconds=job.memory.last_snapshot_s,
        own_bytes=job.memory.own_bytes,
        held_bytes=job.memory.held_bytes,
        skipped=job.memory.skipped,
    )
    job.watchdog.beat(step)


def _preempt(job: Job, step: int, signum: int, saved: bool, loss: float) -> NoReturn:
    """Checkpoint ``step`` (unless it just was), record the stop and exit 128 + ``signum``.

    No rank leaves before rank 0 has committed the checkpoint (the other ranks of an async save
    are done before that commit): a node whose ranks had left would report no checkpoint
    (aihpc.runtime.torchrun), and ``srun --kill-on-bad-exit`` would end the others mid-commit."""
    if not saved:
        checkpoint(job, step, loss)
    job.manager.close()
    job.events("preempted", step=step, signal=signum)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    raise Preempted(signum, step)


def run_loop(job: Job, start: int, progress: bool) -> dict[str, Any]:
    ctx, spec, t, stepper = job.ctx, job.spec, job.spec.training, job.stepper
    tokens_per_step = spec.plan().global_batch_size * stepper.loader.seq_len
    # bf16 autocast on GPUs. On the CPU the runtime computes in fp32: on CPUs without native
    # bf16 GEMMs (no AVX512-BF16 / AMX) autocast made a tiny model's step 15x slower (measured).
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if ctx.device.type == "cuda" else nullcontext()
    )
    step, loss = start, logged_loss(job.metrics, start) if start else None
    job.step_times.clear()
    with (
        PreemptWatch() as preempt,
        progress_bar(progress and ctx.is_main, t.train_steps, start) as report,
    ):
        for step in range(start + 1, t.train_steps + 1):
            loss = stepper.step(autocast)
            dt = stepper.last_step_s
            job.step_times.append(dt)
            job.observe.step(
                step,
                step_time_s=dt,
                tokens=tokens_per_step,
                loss=loss,
                learning_rate=stepper.scheduler.get_last_lr()[0],
                grad_norm=stepper.last_grad_norm,
                phases=stepper.last_phases,
            )
            job.watchdog.beat(step)
            if ctx.is_main:
                record = {
                    "step": step,
                    "loss": loss,
                    "loss_hex": loss.hex(),
                    "lr": stepper.scheduler.get_last_lr()[0],
                    "step_time_s": dt,
                    "tokens_per_s": tokens_per_step / dt,
                    "end_unix": time.time(),
                }
                with open(job.metrics, "a") as f:
                    f.write(to_json(record) + "\n")
                info = f"loss {loss:.4f}  {dt * 1e3:.0f} ms/step  {tokens_per_step / dt:,.0f} tok/s"
                report(step, info, step % t.log_interval == 0 or step == t.train_steps)
            if step == start + 1:
                job.events("first_step", step=step)
            saved = step % spec.checkpoint.interval_steps == 0 or step == t.train_steps
            if saved:
                checkpoint(job, step, loss)
            if job.memory is not None and step % spec.checkpoint.memory_interval_steps == 0:
                snapshot(job, step)
            signum = preempt.agreed(device=ctx.device)  # SIGTERM / SIGUSR1: save, exit 128+sig
            if signum:
                _preempt(job, step, signum, saved, loss)
            if job.injector.due(step, "step", ("kill", "hang", "exception")):
                kinds = [f.kind for f in job.injector.due(step, "step")]
                job.events("fault", step=step, kinds=kinds)
                job.injector.fire(step, "step")
    return {"final_step": step, "final_loss": loss}
