"""The trainer: one run spec → a Llama decoder trained under its plan (DDP / FSDP2 / HSDP, tensor
and sequence parallel, pipeline schedules, context parallel), resumable bit for bit.

Everything a resumed run needs to continue exactly lives in one ``state`` mapping that the
CheckpointManager saves and restores: model + optimizer (FQN-keyed, reshardable), the LR schedule,
the data cursor and the RNG. ``state_sha256`` over the same mapping is the run's fingerprint.

This module runs a launch: process groups, the run directory's lock, in-process restarts and the
summary. The job it trains is built by job.py, stepped by loop.py and reported by summary.py.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from aihpc.observe.metrics import open_train_metrics
from aihpc.resilience import (
    CheckpointManager,
    FaultInjector,
    Watchdog,
    state_sha256,
)
from aihpc.runspec import RunSpec, SpecError
from aihpc.runtime.distributed import (
    DistContext,
    init_distributed,
    launcher_env,
    rendezvous_store,
)
from aihpc.runtime.job import (
    Bounds,
    Job,
    TrainOptions,
    build,
    build_optimizer,
    count_params,
    device_memory,
    lr_lambda,
    memory_tier,
    prepare_records,
    restore,
)
from aihpc.runtime.loop import run_loop
from aihpc.runtime.ownership import hold_run_dir
from aihpc.runtime.parallelize import unwrap
from aihpc.runtime.recoveries import launch_recoveries, load_record
from aihpc.runtime.rundir import (
    ERROR_LOG_ATTR,
    Events,
    process_start_unix,
    read_summary,
    run_identity,
    trim_metrics,
    write_error_log,
    write_summary,
)
from aihpc.runtime.speed import describe
from aihpc.runtime.summary import device_label, measured_vs_predicted, plan_summary, slurm_job

if TYPE_CHECKING:
    from aihpc.runtime.mesh import Parallel

__all__ = ["TrainOptions", "build_optimizer", "lr_lambda", "run", "train"]

log = logging.getLogger("aihpc.runtime")


def train(
    spec: RunSpec, opts: TrainOptions, ctx: DistContext, watchdog: Watchdog, generation: int = 0
) -> dict[str, Any]:
    """Train ``spec`` in ``ctx``'s process group, resuming from ``opts.run_dir`` if possible.
    ``watchdog`` is started (in its start-up phase); ``train`` moves it through the phases.
    ``generation``: in-process restarts before this one (recorded with every event)."""
    run_dir = opts.run_dir
    repaired = prepare_records(run_dir) if ctx.is_main else []
    dist.barrier()  # nobody appends before rank 0 has repaired the logs
    events = Events(run_dir / "events.jsonl", ctx.rank, watchdog.attempt, generation)
    events("process_start", process_start_unix=process_start_unix(), world_size=ctx.world_size)
    for note in repaired:
        log.warning("%s", note)
        events("log_repaired", detail=note)
    injector = FaultInjector(list(opts.faults), ctx.rank, run_dir)
    observe = open_train_metrics(  # a no-op without --metrics-port / --metrics-textfile
        opts.metrics,
        spec=spec,
        run_dir=run_dir,
        rank=ctx.rank,
        local_rank=ctx.local_rank,
        world_size=ctx.world_size,
        attempt=watchdog.attempt,
        device_memory=device_memory(ctx),
    )
    on_hang = watchdog.on_hang
    watchdog.on_hang = lambda ev: (on_hang and on_hang(ev), observe.hang())
    done = False
    try:
        result = _train(spec, opts, ctx, watchdog, events, injector, observe)
        result["in_process_restarts"] = generation
        done = True
        return result
    finally:
        watchdog.on_hang = on_hang  # a next generation wraps the launcher's handler afresh
        observe.close(final=done)  # final: wait (briefly) for a last scrape


def _train(
    spec: RunSpec,
    opts: TrainOptions,
    ctx: DistContext,
    watchdog: Watchdog,
    events: Events,
    injector: FaultInjector,
    observe: Any,
) -> dict[str, Any]:
    run_dir = opts.run_dir
    injector.fire(0, "start")
    par, parts, stepper, state = build(spec, opts, ctx)
    events("speed_features", **describe(unwrap(parts.model), spec.training, ctx.device.type))
    manager = CheckpointManager(
        run_dir / "checkpoints",
        keep_last=spec.checkpoint.keep_last,
        async_save=spec.checkpoint.async_save,
        process_group=ctx.checkpoint_group,
        before_commit=lambda step: injector.fire(step, at="save"),
        identity=run_identity(spec, opts.data, opts.tokenizer),
    )
    # the memory tier's group and placement are set up with the others, before the load
    memory = memory_tier(spec, opts, ctx, par)
    if memory is not None:
        injector.lose_node_memory = memory.drop_own
    events("pg_ready")
    bounds = Bounds.of(spec, opts, ctx.world_size)
    watchdog.phase("load", bounds.load(manager.root))
    injector.fire(0, "load")
    t_load = time.perf_counter()
    start, source = restore(manager, memory, state)
    held = memory is not None and any(i["own"] is not None or i["held"] for i in memory.inventory)
    if held and source.get("source") != "memory":  # copies were there but not usable: say why
        events("memory_not_used", inventory=memory.inventory)
    if start:
        observe.loaded(start, time.perf_counter() - t_load)
    for problem in manager.problems:
        events("checkpoint_problem", detail=problem)
    events("loaded", step=start, source=source.get("source"), from_peer=source.get("from_peer"))
    metrics = run_dir / "metrics.jsonl"
    lost = trim_metrics(metrics, start) if ctx.is_main else []  # [first, last] step ranges
    if lost:
        events("loss_history_lost", steps=lost)
    watchdog.phase("first step", opts.startup_timeout_s)  # one-off work: allocations, comms
    num_params = count_params(parts, par)
    job = Job(
        stepper, state, manager, injector, watchdog, events, ctx, spec, metrics, bounds,
        16 * num_params / ctx.world_size, observe, memory,
    )  # fmt: skip
    result = run_loop(job, start, opts.progress)
    result["loss_history_lost"] = lost
    return _finish(job, result, start, source, par, num_params)


def _finish(
    job: Job,
    result: dict[str, Any],
    start: int,
    source: dict[str, Any],
    par: Parallel,
    num_params: int,
) -> dict[str, Any]:
    """After the last step: the final commit, the state hash, the memory tier freed, and the
    summary of this launch."""
    manager, memory, spec, ctx = job.manager, job.memory, job.spec, job.ctx
    job.watchdog.phase("final", job.bounds.final(manager.last_state_bytes or job.state_bytes_guess))
    job.injector.fire(0, "final")
    manager.close()
    result["state_sha256"] = state_sha256(job.state)
    if memory is not None:
        result["memory_checkpoint"] = memory.report()
        memory.discard()  # the run is over: its memory is freed
        memory.close()
    result["restored_from"] = source.get("source")
    plan = spec.plan()
    ev = job.events
    result.update(
        restarts=job.watchdog.attempt,  # torchrun's restarts of the worker group in this launch
        **slurm_job(),  # requeues: Slurm's of the job this launch ran in
        world_size=ctx.world_size,
        resumed_from_step=start,
        # the step and tier of this load, and of every load after a fault in the launch
        resumed_from=load_record(
            start, source.get("source"), source.get("from_peer"), ev.attempt, ev.generation
        ),
        recoveries=launch_recoveries(ev.path) if ctx.is_main else [],
        plan=plan_summary(par),
        zero_stage=plan.zero_stage,
        recompute=plan.recompute,
        micro_batch_size=job.stepper.micro,
        grad_accum_steps=plan.global_batch_size // (par.dims.dp * job.stepper.micro),
        num_params=num_params,
        performance=_performance(job),
    )
    job.events("done", step=result["final_step"])
    return result


def _performance(job: Job) -> dict[str, Any]:
    """Measured against predicted: a VLM's with its encoder and imbalance (runtime/vlm/)."""
    spec, ctx = job.spec, job.ctx
    if spec.vision is not None:
        from aihpc.runtime.vlm.summary import vlm_measured_vs_predicted

        log = job.stepper.image_log  # type: ignore[attr-defined]
        return vlm_measured_vs_predicted(
            spec, job.step_times, ctx.world_size, device_label(ctx.device), log
        )
    return measured_vs_predicted(spec, job.step_times, ctx.world_size, device_label(ctx.device))


@contextmanager
def _logged_before_teardown(
    run_dir: Path, rank: int, final: Callable[[Exception], bool]
) -> Iterator[None]:
    """Write the traceback of an error that ends this rank (``final``) to its log before the
    process group is torn down: the teardown closes the rank's sockets, its peers fail at once
    on the lost connection and the agent may stop this rank before it says what happened. The
    launcher names the failure from this log (``launch.describe_failure``); the exception
    carries the log's path (``ERROR_LOG_ATTR``) so it is written once."""
    try:
        yield
    except SpecError:
        raise  # the command's own one-line refusal, not a failure
    except Exception as err:
        if final(err) and not hasattr(err, ERROR_LOG_ATTR):
            attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            with suppress(OSError):  # an unwritable log must not hide the error
                setattr(err, ERROR_LOG_ATTR, write_error_log(run_dir, rank, attempt, err))
        raise


def run(spec: RunSpec, opts: TrainOptions, timeout_s: float = 600.0) -> dict[str, Any]:
    """Init distributed, train, and (rank 0) write ``run_dir/summary.json`` atomically.

    Unless the launcher holds the run directory (``opts.lock_held``), rank 0 takes its lock
    first, for the whole launch, and a job refused it ends on every rank with RunDirRefused
    before it has written anything there (aihpc.runtime.ownership).

    With ``[checkpoint] in_process_restarts``, an exception or a hang (found by the watchdog) in
    any rank (unset: an exception, on CPU / gloo; ``_in_process_limit``) starts a new
    generation in the same processes: new process groups over the same
    store, the model rebuilt, the state restored (from memory when the tier is on), up to that
    many times per launch (docs/resilience.md, "In-process restart").

    A run that had no step left to train (it finished before) keeps its summary: it is
    returned, not rewritten.
    """
    from aihpc.resilience.inprocess import Interrupter

    opts.run_dir.mkdir(parents=True, exist_ok=True)
    found = launcher_env()
    rank = int(found["RANK"]) if found else 0
    world = int(found["WORLD_SIZE"]) if found else 1
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    limit = _in_process_limit(spec)
    # The job's store, before anything is written in the directory: it carries rank 0's verdict
    # on the lock, and the in-process generations' process groups are formed over it.
    store = None
    if limit or (world > 1 and not opts.lock_held):
        store = rendezvous_store(timeout_s)
    with (
        nullcontext() if opts.lock_held else hold_run_dir(opts.run_dir, rank, world, attempt, store)
    ):
        hang_events = Events(opts.run_dir / "events.jsonl", rank, attempt)
        # hangs too where the field is set; unset, only exceptions (a peer's SIGSTOP looks like
        # a stall here, and an interrupt then only delays the agent's restart by a bound)
        hangs = limit and spec.checkpoint.in_process_restarts is not None
        interrupter = Interrupter() if hangs else None
        watchdog = Watchdog(
            opts.run_dir,
            rank,
            opts.hang_timeout_s,
            startup_timeout_s=opts.startup_timeout_s,
            attempt=attempt,
            on_hang=lambda ev: hang_events(**ev),
            watch_parent=opts.watch_parent,
            on_stall=_on_stall(interrupter, hang_events) if interrupter else None,
        ).start()
        try:
            if not limit:
                return _generation(spec, opts, watchdog, timeout_s, lambda err: True, store)
            return _generations(
                spec, opts, watchdog, timeout_s, interrupter, hang_events, store, limit
            )
        finally:
            watchdog.stop()


def _in_process_limit(spec: RunSpec) -> int:
    """``[checkpoint] in_process_restarts``, or where unset the safe default (on for exceptions
    on gloo, off on CUDA: ``CheckpointSpec.in_process_limit``)."""
    return spec.checkpoint.in_process_limit(torch.cuda.is_available())


def _on_stall(interrupter: Any, events: Events) -> Callable[[dict], bool]:
    def on_stall(ev: dict[str, Any]) -> bool:
        acted = interrupter.interrupt(f"no progress for {ev['stalled_s']} s in {ev['phase']}")
        if acted:
            events("hang_interrupted", **ev)
        return acted

    return on_stall


def _generations(
    spec: RunSpec,
    opts: TrainOptions,
    watchdog: Watchdog,
    timeout_s: float,
    interrupter: Any,  # None: hangs are the watchdog's exit, not an in-process restart
    events: Events,
    store: Any,
    limit: int,
) -> dict[str, Any]:
    """Run generations until one finishes (at most ``limit`` restarts); after a restartable
    fault, release the failed one (its process groups close, so blocked peers fail too) and
    start the next, over the same ``store``."""
    from aihpc.resilience.inprocess import release, restartable, shutdown_collective_sockets

    generation = 0
    while True:
        try:
            with interrupter.armed(generation) if interrupter else nullcontext():
                summary = _generation(
                    spec,
                    opts,
                    watchdog,
                    timeout_s,
                    final=lambda err, g=generation: g >= limit or not restartable(err),
                    store=store,
                    generation=generation,
                )
            return summary
        except Exception as err:
            if generation >= limit or not restartable(err):
                raise
            # the restart's own clock: a rank that learnt of the fault from a collective error
            # must not then be found stalled for the time it spent blocked before
            watchdog.phase("restart", opts.startup_timeout_s)
            cause = f"{type(err).__name__}: {err}"[:300]
            events("inprocess_restart", generation=generation + 1, cause=cause)
            log.warning("in-process restart %d after %s", generation + 1, cause)
            closed = shutdown_collective_sockets({int(os.environ.get("MASTER_PORT", "0"))})
            release(err)
            del err
            events("inprocess_released", generation=generation + 1, sockets_closed=closed)
            generation += 1


def _generation(
    spec: RunSpec,
    opts: TrainOptions,
    watchdog: Watchdog,
    timeout_s: float,
    final: Callable[[Exception], bool],
    store: Any = None,
    generation: int = 0,
) -> dict[str, Any]:
    with (
        init_distributed(timeout_s, store, generation) as ctx,
        _logged_before_teardown(opts.run_dir, ctx.rank, final),
    ):
        summary = train(spec, opts, ctx, watchdog, generation)
        previous = read_summary(opts.run_dir)
        if summary["final_step"] == summary["resumed_from_step"] and previous:
            summary = previous  # nothing was trained: the record stays as it was
        elif ctx.is_main:
            write_summary(opts.run_dir, summary)
        dist.barrier()
    return summary
