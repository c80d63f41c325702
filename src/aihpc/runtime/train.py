"""The trainer: one run spec → a Llama decoder trained under its plan (DDP / FSDP2 / HSDP, tensor
and sequence parallel, pipeline schedules, context parallel), resumable bit for bit.

Everything a resumed run needs to continue exactly lives in one ``state`` mapping that the
CheckpointManager saves and restores: model + optimizer (FQN-keyed, reshardable), the LR schedule,
the data cursor and the RNG. ``state_sha256`` over the same mapping is the run's fingerprint.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

from aihpc._io import to_json
from aihpc.observe.metrics import MetricsConfig, open_train_metrics
from aihpc.resilience import (
    CheckpointManager,
    Fault,
    FaultInjector,
    ModelOptimizerState,
    RNGState,
    RunDirBusyError,
    RunDirLock,
    Watchdog,
    state_sha256,
)
from aihpc.resilience.manifest import committed_checkpoints, manifest_bytes
from aihpc.resilience.preempt import Preempted, PreemptWatch
from aihpc.runtime.checks import check_plan, check_trainable
from aihpc.runtime.data import TokenLoader, load_tokens
from aihpc.runtime.distributed import DistContext, init_distributed, launcher_env
from aihpc.runtime.mesh import Parallel
from aihpc.runtime.moe import MoE
from aihpc.runtime.parallelize import ModelParts, build_parallel_model
from aihpc.runtime.pp import build_schedule
from aihpc.runtime.rundir import (
    ERROR_LOG_ATTR,
    DEFAULT_RANK_STORAGE_GBps,
    Events,
    logged_loss,
    phase_bound_s,
    process_start_unix,
    read_summary,
    repair_jsonl,
    run_identity,
    trim_metrics,
    write_error_log,
    write_summary,
)
from aihpc.runtime.step import Stepper, token_loss
from aihpc.spec import RunSpec, SpecError, TrainingSpec

__all__ = ["TrainOptions", "build_optimizer", "lr_lambda", "run", "train"]

log = logging.getLogger("aihpc.runtime")


@dataclass(frozen=True)
class TrainOptions:
    run_dir: Path
    data: Path | None = None
    faults: tuple[Fault, ...] = ()
    hang_timeout_s: float = 300.0
    startup_timeout_s: float = 600.0
    progress: bool = True
    # The launcher already holds the run directory's lock (a single process, or aihpc's own
    # agent); under torchrun or srun rank 0 takes it once the process group is up.
    lock_held: bool = False
    watch_parent: int | None = None  # exit when the launcher with this PID is gone
    metrics: MetricsConfig | None = None  # Prometheus: --metrics-port / --metrics-textfile


def lr_lambda(t: TrainingSpec) -> Callable[[int], float]:
    """Linear warmup to learning_rate, then cosine decay to learning_rate * min_lr_ratio."""

    def factor(step: int) -> float:
        # LambdaLR calls this with the number of scheduler steps taken (0 before the first).
        s = step + 1
        if s <= t.warmup_steps:
            return s / t.warmup_steps
        span = max(1, t.train_steps - t.warmup_steps)
        progress = min(1.0, (s - t.warmup_steps) / span)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_optimizer(model: torch.nn.Module, t: TrainingSpec) -> tuple[torch.optim.AdamW, LambdaLR]:
    # No weight decay on norms (1-D parameters), as in Llama / nanoGPT.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": t.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=t.learning_rate,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=1e-8,
    )
    return opt, LambdaLR(opt, lr_lambda(t))


@contextmanager
def _progress(enabled: bool, total: int, done: int) -> Iterator[Callable[[int, str, bool], None]]:
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


@dataclass(frozen=True)
class _Bounds:
    """How long a rank may stay in each phase (docs/resilience.md, "Hangs"): the hang timeout
    plus four times its share of the checkpoint at the storage bandwidth (the cluster spec's
    storage figure split over the ranks, else DEFAULT_RANK_STORAGE_GBps)."""

    hang_s: float
    rank_GBps: float
    world: int

    @classmethod
    def of(cls, spec: RunSpec, opts: TrainOptions, world: int) -> _Bounds:
        c = spec.cluster
        bws = [b for b in (c.storage_write_bw_GBps, c.storage_read_bw_GBps) if b]
        rank_GBps = min(bws) / world if bws else DEFAULT_RANK_STORAGE_GBps
        return cls(opts.hang_timeout_s, rank_GBps, world)

    def load(self, checkpoint_root: Path) -> float:
        committed, _ = committed_checkpoints(checkpoint_root)
        total = manifest_bytes(committed[-1].path) if committed else 0
        return phase_bound_s(self.hang_s, total / self.world, self.rank_GBps)

    def save(self, rank_bytes: float) -> float:
        return phase_bound_s(self.hang_s, rank_bytes, self.rank_GBps)

    def final(self, rank_bytes: float) -> float:
        # the last commit, then state_sha256 gathers the whole state onto every rank
        return phase_bound_s(self.hang_s, rank_bytes * (1 + self.world), self.rank_GBps)


def _prepare_records(run_dir: Path) -> list[str]:
    """Before anything is appended: cut torn last lines off the append-only logs."""
    notes = [repair_jsonl(run_dir / name) for name in ("metrics.jsonl", "events.jsonl")]
    return [n for n in notes if n]


def _build(
    spec: RunSpec, opts: TrainOptions, ctx: DistContext
) -> tuple[Parallel, ModelParts, Stepper, dict[str, Any]]:
    """The plan laid out over the ranks, the rank's model, its step runner and its state."""
    t, plan = spec.training, spec.plan()
    cfg, micro, accum = check_trainable(spec, ctx.world_size, opts.data)
    par = Parallel(check_plan(spec, ctx.world_size), ctx.device.type)
    torch.manual_seed(t.seed)  # same on every rank: the RNG state is one, not per rank
    parts = build_parallel_model(cfg, ctx, par, t.seed, plan.recompute)
    optimizer, scheduler = build_optimizer(parts.model, t)
    loader = TokenLoader(load_tokens(opts.data), cfg.max_seq_len, plan.global_batch_size, t.seed)
    positions = parts.model.positions.cpu() if par.dims.cp > 1 else None
    schedule = None
    if par.dims.pp > 1:
        schedule = build_schedule(
            parts.stages, parts.stage_ids, par.dims, par.pp_group, ctx.device, accum, token_loss
        )
    moe = [m for m in parts.model.modules() if isinstance(m, MoE)]
    if par.ep_mesh is not None:
        _quiet_two_step_redistribute()
    for block in moe:
        # the balance loss's gradient joins the token loss's: divided by the micro-batches as
        # the token loss is (the pipeline schedules divide the gradients instead)
        block.aux_loss_scale = 1.0 if schedule is not None else 1.0 / accum
    stepper = Stepper(
        parts, par, optimizer, scheduler, loader, micro, t.grad_clip, ctx.device, schedule,
        positions, moe=bool(moe),
    )  # fmt: skip
    state = {
        "train": ModelOptimizerState(parts.model, optimizer),
        "sched": scheduler,
        "data": loader,
        "rng": RNGState(),
    }
    return par, parts, stepper, state


def _quiet_two_step_redistribute() -> None:
    """Expert weights live on a 2-D (expert-DP x EP) mesh, so DTensor reduces their gradient
    norm, and gathers them for state_sha256, in two collectives, and says so on every rank
    ("While redistributing from ... 2 sequential ..."): by design here, and not the user's to
    act on, so the trainer drops that one message."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    if not any(isinstance(f, _TwoStepFilter) for f in logger.filters):
        logger.addFilter(_TwoStepFilter())


class _TwoStepFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("While redistributing from")


def train(
    spec: RunSpec, opts: TrainOptions, ctx: DistContext, watchdog: Watchdog, generation: int = 0
) -> dict[str, Any]:
    """Train ``spec`` in ``ctx``'s process group, resuming from ``opts.run_dir`` if possible.
    ``watchdog`` is started (in its start-up phase); ``train`` moves it through the phases.
    ``generation``: in-process restarts before this one (recorded with every event)."""
    run_dir = opts.run_dir
    repaired = _prepare_records(run_dir) if ctx.is_main else []
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
        device_memory=_device_memory(ctx),
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


def _device_memory(ctx: DistContext) -> Callable[[], dict[str, float]] | None:
    """The CUDA caching allocator's figures for the metrics (None on the CPU)."""
    if ctx.device.type != "cuda":
        return None
    return lambda: {
        "device_allocated": float(torch.cuda.memory_allocated(ctx.device)),
        "device_reserved": float(torch.cuda.memory_reserved(ctx.device)),
        "device_peak_allocated": float(torch.cuda.max_memory_allocated(ctx.device)),
    }


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
    par, parts, stepper, state = _build(spec, opts, ctx)
    manager = CheckpointManager(
        run_dir / "checkpoints",
        keep_last=spec.checkpoint.keep_last,
        async_save=spec.checkpoint.async_save,
        process_group=ctx.checkpoint_group,
        before_commit=lambda step: injector.fire(step, at="save"),
        identity=run_identity(spec, opts.data),
    )
    # the memory tier's group and placement are set up with the others, before the load
    memory = _memory_tier(spec, opts, ctx, par)
    if memory is not None:
        injector.lose_node_memory = memory.drop_own
    events("pg_ready")
    bounds = _Bounds.of(spec, opts, ctx.world_size)
    watchdog.phase("load", bounds.load(manager.root))
    injector.fire(0, "load")
    t_load = time.perf_counter()
    start, source = _restore(manager, memory, state)
    held = memory is not None and any(i["own"] is not None or i["held"] for i in memory.inventory)
    if held and source.get("source") != "memory":  # copies were there but not usable: say why
        events("memory_not_used", inventory=memory.inventory)
    if start:
        observe.loaded(start, time.perf_counter() - t_load)
    for problem in manager.problems:
        events("checkpoint_problem", detail=problem)
    events("loaded", step=start, source=source.get("source"), from_peer=source.get("from_peer"))
    metrics = run_dir / "metrics.jsonl"
    if ctx.is_main:
        trim_metrics(metrics, start)
    watchdog.phase("first step", opts.startup_timeout_s)  # one-off work: allocations, comms
    num_params = _num_params(parts, par)
    job = _Job(
        stepper, state, manager, injector, watchdog, events, ctx, spec, metrics, bounds,
        16 * num_params / ctx.world_size, observe, memory,
    )  # fmt: skip
    result = _loop(job, start, opts.progress)
    watchdog.phase("final", bounds.final(manager.last_state_bytes or job.state_bytes_guess))
    injector.fire(0, "final")
    manager.close()
    result["state_sha256"] = state_sha256(state)
    if memory is not None:
        result["memory_checkpoint"] = memory.report()
        memory.discard()  # the run is over: its memory is freed
        memory.close()
    result["restored_from"] = source.get("source")
    plan = spec.plan()
    result.update(
        restarts=watchdog.attempt,
        world_size=ctx.world_size,
        resumed_from_step=start,
        plan=_plan_summary(par),
        zero_stage=plan.zero_stage,
        recompute=plan.recompute,
        micro_batch_size=stepper.micro,
        grad_accum_steps=plan.global_batch_size // (par.dims.dp * stepper.micro),
        num_params=num_params,
        performance=measured_vs_predicted(spec, job.step_times, ctx.world_size),
    )
    events("done", step=result["final_step"])
    return result


def as_trained(spec: RunSpec) -> RunSpec:
    """``spec`` with the software facts of this trainer, which the prediction beside its
    measurement must price: eager PyTorch, one kernel per element-wise op (``fused_kernels``
    false: no torch.compile, RMSNorm and RoPE in fp32 as runtime/model.py writes them), and
    ``F.cross_entropy`` on fp32-upcast logits (``cross_entropy`` eager, runtime/step.py),
    DTensor's tensor-parallel collectives issued and waited for in line (``tp_comm_overlap``
    none), every op on a DTensor (tensor-parallel layers, loss parallel, the optimizer on
    DTensor parameters) dispatched eagerly in Python (``dtensor_dispatch`` eager), and under
    context parallelism the ring's attention blocks as matmuls over materialised scores
    (``attention`` unfused, comm/ring.py)."""
    training = dataclasses.replace(
        spec.training,
        fused_kernels=False,
        cross_entropy="eager",
        tp_comm_overlap="none",
        dtensor_dispatch="eager",
        attention="unfused" if spec.plan().cp > 1 else spec.training.attention,
    )
    return dataclasses.replace(spec, training=training)


def measured_vs_predicted(
    spec: RunSpec, step_times: list[float], world_size: int
) -> dict[str, Any]:
    """This launch's measured step time (median over its steps after the first, which pays for
    allocations and first-touch communication) and MFU beside ``aihpc estimate``'s for the same
    spec with this trainer's software facts (``as_trained``). MFU is over the spec's GPU peak
    (``[cluster] gpu`` or ``gpu_spec``), so on a machine the spec does not describe it says how
    far the run is from the spec's hardware."""
    from aihpc.observe.metrics import predict

    timed = step_times[1:] or step_times
    measured_s = statistics.median(timed) if timed else None
    tokens = spec.plan().global_batch_size * spec.model.seq_length
    p = predict(as_trained(spec))
    out: dict[str, Any] = {
        "measured_step_time_s": measured_s,
        "measured_steps": len(timed),
        "predicted_step_time_s": p.step_time_s if p else None,
        "measured_mfu": None,
        "predicted_mfu": p.mfu if p else None,
        "step_time_error": None,
    }
    if p and measured_s:
        flops = p.model_flops_per_token * tokens
        out["measured_mfu"] = flops / (measured_s * world_size * p.peak_flops)
        out["step_time_error"] = p.step_time_s / measured_s - 1.0
    return out


def _num_params(parts: ModelParts, par: Parallel) -> int:
    """Parameters of the whole model: each pipeline stage counts its own (DTensor numel is the
    global size across data and tensor parallel shards)."""
    local = sum(p.numel() for p in parts.model.parameters())
    if par.dims.pp == 1:
        return local
    total = torch.tensor(float(local))
    dist.all_reduce(total, group=par.pp_group)
    return int(total.item())


def _plan_summary(par: Parallel) -> dict[str, Any]:
    d = par.dims
    return {
        "tp": d.tp,
        "pp": d.pp,
        "vpp": d.vpp,
        "cp": d.cp,
        "dp": d.dp,
        "dp_shard": d.dp_shard,
        "ep": d.ep,
        "sequence_parallel": d.sequence_parallel,
        "pp_schedule": d.pp_schedule if d.pp > 1 else None,
    }


@dataclass
class _Job:
    """What the loop works on, built once by ``train``."""

    stepper: Stepper
    state: dict[str, Any]
    manager: CheckpointManager
    injector: FaultInjector
    watchdog: Watchdog
    events: Events
    ctx: DistContext
    spec: RunSpec
    metrics: Path
    bounds: _Bounds
    state_bytes_guess: float  # per rank, before the first save measures it: fp32 + AdamW
    observe: Any  # aihpc.observe.metrics.NullMetrics | TrainMetrics
    memory: Any = None  # aihpc.resilience.memory.MemoryCheckpoint, when the tier is on
    step_times: list[float] = field(default_factory=list)  # this launch's, s


def _checkpoint(job: _Job, step: int) -> None:
    """Save at ``step`` under the save phase's bound, then fire the faults due after it."""
    manager, injector, events = job.manager, job.injector, job.events
    job.watchdog.phase("save", job.bounds.save(manager.last_state_bytes or job.state_bytes_guess))
    injector.arm_fs(step, manager.root)
    manager.save(step, job.state)
    events("checkpoint_saved", step=step, blocking_s=manager.last_blocking_s)
    job.observe.checkpoint(step, manager.last_blocking_s, manager.root / f"step_{step:08d}")
    job.watchdog.beat(step)
    if injector.due(step, "step", ("corrupt-checkpoint",)):
        manager.wait()
        bad = injector.corrupt(step, manager.root / f"step_{step:08d}")
        events("fault_corrupt", step=step, file=str(bad))


def _memory_tier(spec: RunSpec, opts: TrainOptions, ctx: DistContext, par: Parallel) -> Any:
    """The in-memory peer tier when ``[checkpoint] memory_interval_steps`` is set (collective)."""
    c = spec.checkpoint
    if not c.memory_interval_steps:
        return None
    from aihpc.resilience.memory import MemoryCheckpoint

    identity = {**run_identity(spec, opts.data), "plan": _plan_summary(par)}
    return MemoryCheckpoint(opts.run_dir, identity, max_bytes=c.memory_max_GiB * 2**30)


def _restore(manager: CheckpointManager, memory: Any, state: dict[str, Any]) -> tuple[int, dict]:
    """Load the newest state: from memory (own or peer) when it is consistent on every rank and
    not older than storage, else from storage. (step, {"source": ..., "from_peer": ...})."""
    if memory is not None:
        committed, _ = committed_checkpoints(manager.root)
        latest = [committed[-1].step if committed else None]
        dist.broadcast_object_list(latest, src=0)  # rank 0's view, so every rank plans alike
        got = memory.restore(state, latest[0])
        if got is not None:
            return got["step"], {"source": "memory", "from_peer": got["from_peer"]}
    start = manager.load_latest(state) or 0
    return start, {"source": "storage"} if start else {}


def _snapshot(job: _Job, step: int) -> None:
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


def _loop(job: _Job, start: int, progress: bool) -> dict[str, Any]:
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
        _progress(progress and ctx.is_main, t.train_steps, start) as report,
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
                _checkpoint(job, step)
            if job.memory is not None and step % spec.checkpoint.memory_interval_steps == 0:
                _snapshot(job, step)
            signum = preempt.agreed(device=ctx.device)  # SIGTERM / SIGUSR1: save, exit 128+sig
            if signum:
                if not saved:
                    _checkpoint(job, step)
                job.manager.close()
                job.events("preempted", step=step, signal=signum)
                raise Preempted(signum, step)
            if job.injector.due(step, "step", ("kill", "hang", "exception")):
                kinds = [f.kind for f in job.injector.due(step, "step")]
                job.events("fault", step=step, kinds=kinds)
                job.injector.fire(step, "step")
    return {"final_step": step, "final_loss": loss}


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


@contextmanager
def _own_run_dir(opts: TrainOptions, ctx: DistContext) -> Iterator[None]:
    """Under torchrun or srun, rank 0 holds the run directory's lock for the job (every rank
    learns whether it got it); with aihpc's own launcher the launcher already holds it."""
    if opts.lock_held:
        yield
        return
    lock, busy = None, [None]
    if ctx.is_main:
        try:
            lock = RunDirLock(opts.run_dir).acquire()
        except RunDirBusyError as err:
            busy[0] = err.describe()
    dist.broadcast_object_list(busy, src=0)
    if busy[0]:
        raise SpecError("--run-dir", str(opts.run_dir), busy[0])
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def run(spec: RunSpec, opts: TrainOptions, timeout_s: float = 600.0) -> dict[str, Any]:
    """Init distributed, train, and (rank 0) write ``run_dir/summary.json`` atomically.

    With ``[checkpoint] in_process_restarts``, an exception or a hang (found by the watchdog)
    in any rank starts a new generation in the same processes: new process groups over the same
    store, the model rebuilt, the state restored (from memory when the tier is on), up to that
    many times per launch (docs/resilience.md, "In-process restart").

    A run that had no step left to train (it finished before) keeps its summary: it is
    returned, not rewritten.
    """
    from aihpc.resilience.inprocess import Interrupter

    opts.run_dir.mkdir(parents=True, exist_ok=True)
    found = launcher_env()
    rank = int(found["RANK"]) if found else 0
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    hang_events = Events(opts.run_dir / "events.jsonl", rank, attempt)
    limit = spec.checkpoint.in_process_restarts
    interrupter = Interrupter() if limit else None
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
        if interrupter is None:
            return _generation(spec, opts, watchdog, timeout_s, final=lambda err: True)
        return _generations(spec, opts, watchdog, timeout_s, interrupter, hang_events)
    finally:
        watchdog.stop()


def _on_stall(interrupter: Any, events: Events) -> Callable[[dict], bool]:
    def on_stall(ev: dict[str, Any]) -> bool:
        acted = interrupter.interrupt(f"no progress for {ev['stalled_s']} s in {ev['phase']}")
        if acted:
            events("hang_interrupted", **ev)
        return acted

    return on_stall


def _restartable(err: BaseException) -> bool:
    """In-process restart is for faults of the moment, not for errors a rerun repeats."""
    from aihpc.resilience.manifest import CheckpointCorruptError

    return isinstance(err, Exception) and not isinstance(err, SpecError | CheckpointCorruptError)


def _generations(
    spec: RunSpec,
    opts: TrainOptions,
    watchdog: Watchdog,
    timeout_s: float,
    interrupter: Any,
    events: Events,
) -> dict[str, Any]:
    """Run generations until one finishes; after a restartable fault, release the failed one
    (its process groups close, so blocked peers fail too) and start the next."""
    from aihpc.resilience.inprocess import release, shutdown_collective_sockets
    from aihpc.runtime.distributed import rendezvous_store

    store = rendezvous_store(timeout_s)
    limit = spec.checkpoint.in_process_restarts
    generation = 0
    while True:
        try:
            with interrupter.armed(generation):
                summary = _generation(
                    spec,
                    opts,
                    watchdog,
                    timeout_s,
                    final=lambda err, g=generation: g >= limit or not _restartable(err),
                    store=store,
                    generation=generation,
                )
            return summary
        except Exception as err:
            if generation >= limit or not _restartable(err):
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
        _own_run_dir(opts, ctx),
    ):
        summary = train(spec, opts, ctx, watchdog, generation)
        previous = read_summary(opts.run_dir)
        if summary["final_step"] == summary["resumed_from_step"] and previous:
            summary = previous  # nothing was trained: the record stays as it was
        elif ctx.is_main:
            write_summary(opts.run_dir, summary)
        dist.barrier()
    return summary
