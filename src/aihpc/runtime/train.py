"""The trainer: one run spec → a Llama decoder trained with DDP / FSDP2, resumable bit for bit.

Everything a resumed run needs to continue exactly lives in one ``state`` mapping that the
CheckpointManager saves and restores: model + optimizer (FQN-keyed, reshardable), the LR schedule,
the data cursor and the RNG. ``state_sha256`` over the same mapping is the run's fingerprint.
"""

from __future__ import annotations

import json
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

from aihpc.observe.metrics import MetricsConfig, open_train_metrics
from aihpc.resilience import (
    CheckpointManager,
    Fault,
    FaultInjector,
    ModelOptimizerState,
    RNGState,
    Watchdog,
    state_sha256,
)
from aihpc.runtime.data import (
    ByteTokenizer,
    TokenLoader,
    load_tokens,
    token_count,
    token_vocab_needed,
)
from aihpc.runtime.distributed import DistContext, init_distributed
from aihpc.runtime.model import LlamaConfig
from aihpc.runtime.parallelize import build_parallel_model
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
    metrics: MetricsConfig | None = None  # observe: --metrics-port / --metrics-textfile


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
        needed = token_vocab_needed(data)
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


class _Events:
    """Append-only JSON lines shared by all ranks (O_APPEND keeps short lines whole)."""

    def __init__(self, path: Path, rank: int, attempt: int):
        self.path, self.rank, self.attempt = path, rank, attempt

    def __call__(self, event: str, **fields: Any) -> None:
        line = (
            json.dumps(
                {
                    "event": event,
                    "rank": self.rank,
                    "attempt": self.attempt,
                    "time_unix": time.time(),
                    **fields,
                }
            )
            + "\n"
        )
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def _process_start_unix() -> float | None:
    """When this process was created (Linux /proc), for the recovery-time split.

    Age from /proc/uptime minus the start tick, subtracted from time.time(): one clock, unlike
    /proc/stat's whole-second btime.
    """
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _device_memory(ctx: DistContext) -> Callable[[], dict[str, float]] | None:
    """observe: the CUDA caching allocator's figures for the metrics (None on the CPU)."""
    if ctx.device.type != "cuda":
        return None
    return lambda: {
        "device_allocated": float(torch.cuda.memory_allocated(ctx.device)),
        "device_reserved": float(torch.cuda.memory_reserved(ctx.device)),
        "device_peak_allocated": float(torch.cuda.max_memory_allocated(ctx.device)),
    }


def _rewrite_metrics(path: Path, keep_through: int) -> None:
    """On resume, drop logged steps past the checkpoint: they are about to be replayed."""
    if not path.exists():
        return
    lines = [
        ln
        for ln in path.read_text().splitlines()
        if ln.strip() and json.loads(ln)["step"] <= keep_through
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(ln + "\n" for ln in lines))
    os.replace(tmp, path)


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


def train(spec: RunSpec, opts: TrainOptions, ctx: DistContext) -> dict[str, Any]:
    """Train ``spec`` in ``ctx``'s process group, resuming from ``opts.run_dir`` if possible."""
    t = spec.training
    cfg, micro, accum = check_trainable(spec, ctx.world_size, opts.data)
    run_dir = opts.run_dir
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    events = _Events(run_dir / "events.jsonl", ctx.rank, attempt)
    events("process_start", process_start_unix=_process_start_unix(), world_size=ctx.world_size)
    injector = FaultInjector(list(opts.faults), ctx.rank, run_dir)
    observe = open_train_metrics(  # observe: Prometheus exporter (a no-op without --metrics-*)
        opts.metrics,
        spec=spec,
        run_dir=run_dir,
        rank=ctx.rank,
        local_rank=ctx.local_rank,
        world_size=ctx.world_size,
        attempt=attempt,
        device_memory=_device_memory(ctx),
    )
    watchdog = Watchdog(
        run_dir,
        ctx.rank,
        opts.hang_timeout_s,
        startup_timeout_s=opts.startup_timeout_s,
        attempt=attempt,
        on_hang=lambda ev: (events(**ev), observe.hang()),  # observe: hang()
    ).start()
    done = False  # observe: close(final=done)
    try:
        torch.manual_seed(t.seed)  # same on every rank: the RNG state is one, not per rank
        plan = spec.plan()
        model = build_parallel_model(cfg, ctx, plan.zero_stage, t.seed, plan.recompute)
        optimizer, scheduler = build_optimizer(model, t)
        loader = TokenLoader(
            load_tokens(opts.data), cfg.max_seq_len, plan.global_batch_size, t.seed
        )
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
        )
        events("pg_ready")
        t_load = time.perf_counter()  # observe
        start = manager.load_latest(state) or 0
        if start:  # observe
            observe.loaded(start, time.perf_counter() - t_load)
        events("loaded", step=start)
        metrics = run_dir / "metrics.jsonl"
        if ctx.is_main:
            _rewrite_metrics(metrics, start)
        watchdog.expect_slow()  # the first step after start-up includes one-off work
        job = _Job(
            model,
            optimizer,
            scheduler,
            loader,
            state,
            manager,
            injector,
            watchdog,
            events,
            ctx,
            spec,
            micro,
            accum,
            metrics,
            observe,
        )
        result = _loop(job, start, opts.progress)
        watchdog.expect_slow()  # the last async commit and the hash may outlast a step
        manager.close()
        result["state_sha256"] = state_sha256(state)
        result.update(
            restarts=attempt,
            world_size=ctx.world_size,
            resumed_from_step=start,
            zero_stage=plan.zero_stage,
            recompute=plan.recompute,
            micro_batch_size=micro,
            grad_accum_steps=accum,
            num_params=sum(p.numel() for p in model.parameters()),
        )
        events("done", step=result["final_step"])
        done = True  # observe
        return result
    finally:
        watchdog.stop()
        observe.close(final=done)  # observe


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
    events: _Events
    ctx: DistContext
    spec: RunSpec
    micro: int
    accum: int
    metrics: Path
    observe: Any = None  # observe: aihpc.observe.metrics.NullMetrics | TrainMetrics


def _loop(job: _Job, start: int, progress: bool) -> dict[str, Any]:
    model, optimizer, scheduler, loader = job.model, job.optimizer, job.scheduler, job.loader
    manager, injector, watchdog, events = job.manager, job.injector, job.watchdog, job.events
    ctx, spec, micro, accum, metrics = job.ctx, job.spec, job.micro, job.accum, job.metrics
    t, state = spec.training, job.state
    tokens_per_step = spec.plan().global_batch_size * loader.seq_len
    loss = float("nan")
    is_fsdp = hasattr(model, "set_requires_gradient_sync")
    # bf16 autocast on GPUs. On the CPU the runtime computes in fp32: on CPUs without native
    # bf16 GEMMs (no AVX512-BF16 / AMX) autocast made a tiny model's step 15x slower (measured).
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if ctx.device.type == "cuda" else nullcontext()
    )
    step = start
    with _progress(progress and ctx.is_main, t.train_steps, start) as report:
        for step in range(start + 1, t.train_steps + 1):
            t0 = time.perf_counter()
            batches = loader.next_batch(ctx.rank, ctx.world_size, micro)
            t_data = time.perf_counter()  # observe
            local = torch.zeros((), dtype=torch.float32, device=ctx.device)
            for i, (x, y) in enumerate(batches):
                last = i == len(batches) - 1
                if is_fsdp:
                    model.set_requires_gradient_sync(last)
                sync = (
                    nullcontext() if (last or is_fsdp or ctx.world_size == 1) else model.no_sync()
                )
                with sync:
                    with autocast:
                        logits = model(x.to(ctx.device))
                    mb_loss = (
                        F.cross_entropy(logits.float().flatten(0, 1), y.to(ctx.device).flatten())
                        / accum
                    )
                    mb_loss.backward()
                local += mb_loss.detach()
            t_fb = time.perf_counter()  # observe
            grad_norm = None  # observe
            if t.grad_clip > 0:
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            t_opt = time.perf_counter()  # observe
            dist.all_reduce(local, op=dist.ReduceOp.AVG)
            loss = local.item()
            dt = time.perf_counter() - t0
            job.observe.step(  # observe
                step,
                step_time_s=dt,
                tokens=tokens_per_step,
                loss=loss,
                learning_rate=scheduler.get_last_lr()[0],
                grad_norm=grad_norm,
                phases={
                    "data_wait": t_data - t0,
                    "forward_backward": t_fb - t_data,
                    "optimizer": t_opt - t_fb,
                    "loss_sync": t0 + dt - t_opt,
                },
            )
            watchdog.beat(step)
            if ctx.is_main:
                with open(metrics, "a") as f:
                    f.write(
                        json.dumps(
                            {
                                "step": step,
                                "loss": loss,
                                "loss_hex": loss.hex(),
                                "lr": scheduler.get_last_lr()[0],
                                "step_time_s": dt,
                                "tokens_per_s": tokens_per_step / dt,
                                "end_unix": time.time(),
                            }
                        )
                        + "\n"
                    )
                info = f"loss {loss:.4f}  {dt * 1e3:.0f} ms/step  {tokens_per_step / dt:,.0f} tok/s"
                report(step, info, step % t.log_interval == 0 or step == t.train_steps)
            if step == start + 1:
                events("first_step", step=step)
            if step % spec.checkpoint.interval_steps == 0 or step == t.train_steps:
                watchdog.expect_slow()  # a sync save may outlast the step bound
                manager.save(step, state)
                events("checkpoint_saved", step=step, blocking_s=manager.last_blocking_s)
                job.observe.checkpoint(  # observe
                    step, manager.last_blocking_s, manager.root / f"step_{step:08d}"
                )
                watchdog.beat(step)
                if injector.due(step, "step", ("corrupt-checkpoint",)):
                    manager.wait()
                    bad = injector.corrupt(step, manager.root / f"step_{step:08d}")
                    events("fault_corrupt", step=step, file=str(bad))
            if injector.due(step, "step", ("kill", "hang", "exception")):
                events("fault", step=step, kinds=[f.kind for f in injector.due(step, "step")])
                injector.fire(step, "step")
    return {"final_step": step, "final_loss": loss}


def run(spec: RunSpec, opts: TrainOptions, timeout_s: float = 600.0) -> dict[str, Any]:
    """Init distributed, train, and (rank 0) write ``run_dir/summary.json`` atomically."""
    opts.run_dir.mkdir(parents=True, exist_ok=True)
    with init_distributed(timeout_s=timeout_s) as ctx:
        summary = train(spec, opts, ctx)
        if ctx.is_main:
            tmp = opts.run_dir / "summary.json.tmp"
            tmp.write_text(json.dumps(summary, indent=2) + "\n")
            os.replace(tmp, opts.run_dir / "summary.json")
        dist.barrier()
    return summary
