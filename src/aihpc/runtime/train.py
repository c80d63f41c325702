"""The trainer: one run spec → a Llama decoder trained with DDP / FSDP2, resumable bit for bit.

Everything a resumed run needs to continue exactly lives in one ``state`` mapping that the
CheckpointManager saves and restores: model + optimizer (FQN-keyed, reshardable), the LR schedule,
the data cursor and the RNG. ``state_sha256`` over the same mapping is the run's fingerprint.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR

from aihpc._io import to_json
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
from aihpc.runtime.data import (
    ByteTokenizer,
    TokenLoader,
    load_tokens,
    token_count,
    token_vocab_needed,
)
from aihpc.runtime.distributed import DistContext, init_distributed, launcher_env
from aihpc.runtime.model import LlamaConfig
from aihpc.runtime.parallelize import build_parallel_model
from aihpc.runtime.rundir import (
    DEFAULT_RANK_STORAGE_GBps,
    Events,
    logged_loss,
    phase_bound_s,
    process_start_unix,
    read_summary,
    repair_jsonl,
    run_identity,
    trim_metrics,
    write_summary,
)
from aihpc.spec import RunSpec, SpecError, TrainingSpec

__all__ = ["TrainOptions", "build_optimizer", "check_trainable", "lr_lambda", "run", "train"]

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


def check_trainable(
    spec: RunSpec, world_size: int, data: Path | None = None
) -> tuple[LlamaConfig, int, int]:
    """Validate what the runtime needs beyond the spec's own rules: (config, micro, accum).

    ``data``: text (byte tokenizer, so vocab_size must be 256) or a pre-tokenized ``.npy``
    (vocab_size must exceed its largest id; this reads the file once per call).
    """
    cfg = LlamaConfig.from_spec(spec.model)
    if data is not None:
        try:
            count = token_count(data)
        except (ValueError, UnicodeDecodeError) as err:
            what = "a token array" if data.suffix == ".npy" else "UTF-8 text"
            raise SpecError("--data", str(data), f"not {what}: {err}") from None
        seq = spec.model.seq_length
        if count < seq + 1:
            raise SpecError(
                "--data", str(data), f"{count} tokens, fewer than model.seq_length {seq} + 1"
            )
    if data is not None and data.suffix == ".npy":
        lowest, needed = token_vocab_needed(data)
        if lowest < 0:
            raise SpecError("--data", str(data), f"token ids must be >= 0; found {lowest}")
        if cfg.vocab_size < needed:
            raise SpecError(
                "model.vocab_size",
                cfg.vocab_size,
                f"must be at least {needed} (largest token id in {data.name} + 1)",
            )
    elif cfg.vocab_size != ByteTokenizer.vocab_size:
        raise SpecError(
            "model.vocab_size",
            cfg.vocab_size,
            f"must be {ByteTokenizer.vocab_size} for text data (the runtime's byte tokenizer); "
            "pre-tokenized .npy data takes any vocab_size",
        )
    if spec.training.precision != "bf16":
        raise SpecError(
            "training.precision",
            spec.training.precision,
            "the runtime trains with bf16 autocast on GPUs (fp32 on CPUs); allowed: bf16",
        )
    if spec.training.optimizer != "adamw":
        raise SpecError(
            "training.optimizer", spec.training.optimizer, "the runtime implements adamw"
        )
    plan = spec.plan()
    for name in ("tp", "pp", "cp", "ep"):
        if getattr(plan, name) != 1:
            raise SpecError(
                f"parallel.{name}",
                getattr(plan, name),
                "the runtime is data parallel only; allowed: 1",
            )
    if plan.offload_layers:
        raise SpecError(
            "parallel.offload_layers",
            plan.offload_layers,
            "the runtime keeps activations on the device; allowed: 0",
        )
    per_step = world_size * plan.micro_batch_size
    if plan.global_batch_size % per_step:
        raise SpecError(
            "parallel.global_batch_size",
            plan.global_batch_size,
            f"must be a multiple of world size {world_size} x micro_batch_size "
            f"{plan.micro_batch_size} = {per_step}",
        )
    return cfg, plan.micro_batch_size, plan.global_batch_size // per_step


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


def train(
    spec: RunSpec, opts: TrainOptions, ctx: DistContext, watchdog: Watchdog
) -> dict[str, Any]:
    """Train ``spec`` in ``ctx``'s process group, resuming from ``opts.run_dir`` if possible.
    ``watchdog`` is started (in its start-up phase); ``train`` moves it through the phases."""
    t = spec.training
    cfg, micro, accum = check_trainable(spec, ctx.world_size, opts.data)
    run_dir = opts.run_dir
    repaired = _prepare_records(run_dir) if ctx.is_main else []
    dist.barrier()  # nobody appends before rank 0 has repaired the logs
    events = Events(run_dir / "events.jsonl", ctx.rank, watchdog.attempt)
    events("process_start", process_start_unix=process_start_unix(), world_size=ctx.world_size)
    for note in repaired:
        log.warning("%s", note)
        events("log_repaired", detail=note)
    injector = FaultInjector(list(opts.faults), ctx.rank, run_dir)
    injector.fire(0, "start")
    torch.manual_seed(t.seed)  # same on every rank: the RNG state is one, not per rank
    plan = spec.plan()
    model = build_parallel_model(cfg, ctx, plan.zero_stage, t.seed, plan.recompute)
    optimizer, scheduler = build_optimizer(model, t)
    loader = TokenLoader(load_tokens(opts.data), cfg.max_seq_len, plan.global_batch_size, t.seed)
    state = {
        "train": ModelOptimizerState(model, optimizer),
        "sched": scheduler,
        "data": loader,
        "rng": RNGState(),
    }
    manager = CheckpointManager(
        run_dir / "checkpoints",
        keep_last=spec.checkpoint.keep_last,
        async_save=spec.checkpoint.async_save,
        process_group=ctx.checkpoint_group,
        before_commit=lambda step: injector.fire(step, at="save"),
        identity=run_identity(spec, opts.data),
    )
    events("pg_ready")
    bounds = _Bounds.of(spec, opts, ctx.world_size)
    watchdog.phase("load", bounds.load(manager.root))
    injector.fire(0, "load")
    start = manager.load_latest(state) or 0
    for problem in manager.problems:
        events("checkpoint_problem", detail=problem)
    events("loaded", step=start)
    metrics = run_dir / "metrics.jsonl"
    if ctx.is_main:
        trim_metrics(metrics, start)
    watchdog.phase("first step", opts.startup_timeout_s)  # one-off work: allocations, comms
    num_params = sum(p.numel() for p in model.parameters())
    job = _Job(
        model, optimizer, scheduler, loader, state, manager, injector, watchdog, events, ctx,
        spec, micro, accum, metrics, bounds, 16 * num_params / ctx.world_size,
    )  # fmt: skip
    result = _loop(job, start, opts.progress)
    watchdog.phase("final", bounds.final(manager.last_state_bytes or job.state_bytes_guess))
    injector.fire(0, "final")
    manager.close()
    result["state_sha256"] = state_sha256(state)
    result.update(
        restarts=watchdog.attempt,
        world_size=ctx.world_size,
        resumed_from_step=start,
        zero_stage=plan.zero_stage,
        recompute=plan.recompute,
        micro_batch_size=micro,
        grad_accum_steps=accum,
        num_params=num_params,
    )
    events("done", step=result["final_step"])
    return result


@dataclass
class _Job:
    """What the loop works on, built once by ``train``."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    loader: TokenLoader
    state: dict[str, Any]
    manager: CheckpointManager
    injector: FaultInjector
    watchdog: Watchdog
    events: Events
    ctx: DistContext
    spec: RunSpec
    micro: int
    accum: int
    metrics: Path
    bounds: _Bounds
    state_bytes_guess: float  # per rank, before the first save measures it: fp32 + AdamW


def _step(job: _Job, autocast: Any) -> torch.Tensor:
    """One optimizer step over this rank's micro-batches; the rank-mean loss (a tensor)."""
    model, ctx, accum = job.model, job.ctx, job.accum
    is_fsdp = hasattr(model, "set_requires_gradient_sync")
    batches = job.loader.next_batch(ctx.rank, ctx.world_size, job.micro)
    local = torch.zeros((), dtype=torch.float32, device=ctx.device)
    for i, (x, y) in enumerate(batches):
        last = i == len(batches) - 1
        if is_fsdp:
            model.set_requires_gradient_sync(last)
        sync = nullcontext() if (last or is_fsdp or ctx.world_size == 1) else model.no_sync()
        with sync:
            with autocast:
                logits = model(x.to(ctx.device))
            flat = logits.float().flatten(0, 1)
            mb_loss = F.cross_entropy(flat, y.to(ctx.device).flatten()) / accum
            mb_loss.backward()
        local += mb_loss.detach()
    t = job.spec.training
    if t.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
    job.optimizer.step()
    job.scheduler.step()
    job.optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(local, op=dist.ReduceOp.AVG)
    return local


def _checkpoint(job: _Job, step: int) -> None:
    """Save at ``step`` under the save phase's bound, then fire the faults due after it."""
    manager, injector, events = job.manager, job.injector, job.events
    job.watchdog.phase("save", job.bounds.save(manager.last_state_bytes or job.state_bytes_guess))
    injector.arm_fs(step, manager.root)
    manager.save(step, job.state)
    events("checkpoint_saved", step=step, blocking_s=manager.last_blocking_s)
    job.watchdog.beat(step)
    if injector.due(step, "step", ("corrupt-checkpoint",)):
        manager.wait()
        bad = injector.corrupt(step, manager.root / f"step_{step:08d}")
        events("fault_corrupt", step=step, file=str(bad))


def _loop(job: _Job, start: int, progress: bool) -> dict[str, Any]:
    ctx, spec, t = job.ctx, job.spec, job.spec.training
    tokens_per_step = spec.plan().global_batch_size * job.loader.seq_len
    # bf16 autocast on GPUs. On the CPU the runtime computes in fp32: on CPUs without native
    # bf16 GEMMs (no AVX512-BF16 / AMX) autocast made a tiny model's step 15x slower (measured).
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if ctx.device.type == "cuda" else nullcontext()
    )
    step, loss = start, logged_loss(job.metrics, start) if start else None
    with _progress(progress and ctx.is_main, t.train_steps, start) as report:
        for step in range(start + 1, t.train_steps + 1):
            t0 = time.perf_counter()
            loss = _step(job, autocast).item()
            dt = time.perf_counter() - t0
            job.watchdog.beat(step)
            if ctx.is_main:
                record = {
                    "step": step,
                    "loss": loss,
                    "loss_hex": loss.hex(),
                    "lr": job.scheduler.get_last_lr()[0],
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
            if step % spec.checkpoint.interval_steps == 0 or step == t.train_steps:
                _checkpoint(job, step)
            if job.injector.due(step, "step", ("kill", "hang", "exception")):
                kinds = [f.kind for f in job.injector.due(step, "step")]
                job.events("fault", step=step, kinds=kinds)
                job.injector.fire(step, "step")
    return {"final_step": step, "final_loss": loss}


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

    A run that had no step left to train (it finished before) keeps its summary: it is
    returned, not rewritten.
    """
    opts.run_dir.mkdir(parents=True, exist_ok=True)
    found = launcher_env()
    rank = int(found["RANK"]) if found else 0
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    hang_events = Events(opts.run_dir / "events.jsonl", rank, attempt)
    watchdog = Watchdog(
        opts.run_dir,
        rank,
        opts.hang_timeout_s,
        startup_timeout_s=opts.startup_timeout_s,
        attempt=attempt,
        on_hang=lambda ev: hang_events(**ev),
        watch_parent=opts.watch_parent,
    ).start()
    try:
        with init_distributed(timeout_s=timeout_s) as ctx, _own_run_dir(opts, ctx):
            summary = train(spec, opts, ctx, watchdog)
            previous = read_summary(opts.run_dir)
            if summary["final_step"] == summary["resumed_from_step"] and previous:
                summary = previous  # nothing was trained: the record stays as it was
            elif ctx.is_main:
                write_summary(opts.run_dir, summary)
            dist.barrier()
    finally:
        watchdog.stop()
    return summary
