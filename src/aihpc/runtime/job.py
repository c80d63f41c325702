"""A training job's setup: the options of a launch, the plan laid out over the ranks with its
model, optimizer, schedule, data and state (``build``), how long each phase may take
(``Bounds``), the in-memory checkpoint tier, and the restore. The loop that runs it is
loop.py's; the summary it ends with, summary.py's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

from aihpc.observe.metrics import MetricsConfig
from aihpc.resilience import (
    CheckpointManager,
    Fault,
    FaultInjector,
    ModelOptimizerState,
    RNGState,
    Watchdog,
)
from aihpc.resilience.manifest import committed_checkpoints, manifest_bytes
from aihpc.runspec import RunSpec, TrainingSpec
from aihpc.runtime.checks import check_plan, check_trainable
from aihpc.runtime.data import TokenLoader, load_tokens
from aihpc.runtime.distributed import DistContext
from aihpc.runtime.mesh import Parallel
from aihpc.runtime.moe import MoE
from aihpc.runtime.parallelize import ModelParts, build_parallel_model
from aihpc.runtime.pp import build_schedule
from aihpc.runtime.rundir import (
    DEFAULT_RANK_STORAGE_GBps,
    Events,
    phase_bound_s,
    repair_logs,
    run_identity,
)
from aihpc.runtime.step import Stepper, token_loss
from aihpc.runtime.summary import plan_summary

__all__ = [
    "Bounds",
    "Job",
    "TrainOptions",
    "build",
    "build_optimizer",
    "count_params",
    "device_memory",
    "lr_lambda",
    "memory_tier",
    "prepare_records",
    "restore",
]


@dataclass(frozen=True)
class TrainOptions:
    run_dir: Path
    data: Path | None = None
    tokenizer: str | None = None  # a Hugging Face tokenizer.json (text_data.py); None: bytes
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


@dataclass(frozen=True)
class Bounds:
    """How long a rank may stay in each phase (docs/resilience.md, "Hangs"): the hang timeout
    plus four times its share of the checkpoint at the storage bandwidth (the cluster spec's
    storage figure split over the ranks, else DEFAULT_RANK_STORAGE_GBps)."""

    hang_s: float
    rank_GBps: float
    world: int

    @classmethod
    def of(cls, spec: RunSpec, opts: TrainOptions, world: int) -> Bounds:
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


def prepare_records(run_dir: Path) -> list[str]:
    """Before anything is appended: torn and damaged lines of the append-only logs set aside."""
    return repair_logs(run_dir)


def build(
    spec: RunSpec, opts: TrainOptions, ctx: DistContext
) -> tuple[Parallel, ModelParts, Stepper, dict[str, Any]]:
    """The plan laid out over the ranks, the rank's model, its step runner and its state."""
    t, plan = spec.training, spec.plan()
    cfg, micro, accum = check_trainable(spec, ctx.world_size, opts.data, opts.tokenizer)
    par = Parallel(check_plan(spec, ctx.world_size), ctx.device.type)
    if spec.vision is not None:  # a vision-language model: runtime/vlm/
        from aihpc.runtime.vlm.job import build_vlm

        parts, stepper, state = build_vlm(
            spec, cfg, micro, accum, ctx, par, lambda m: build_optimizer(m, t)
        )
        return par, parts, stepper, state
    torch.manual_seed(t.seed)  # same on every rank: the RNG state is one, not per rank
    parts = build_parallel_model(cfg, ctx, par, t.seed, plan.recompute, plan.recompute_modules, t)
    optimizer, scheduler = build_optimizer(parts.model, t)
    tokens = load_tokens(opts.data, opts.tokenizer)
    loader = TokenLoader(tokens, cfg.max_seq_len, plan.global_batch_size, t.seed)
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


def device_memory(ctx: DistContext) -> Callable[[], dict[str, float]] | None:
    """The CUDA caching allocator's figures for the metrics (None on the CPU)."""
    if ctx.device.type != "cuda":
        return None
    return lambda: {
        "device_allocated": float(torch.cuda.memory_allocated(ctx.device)),
        "device_reserved": float(torch.cuda.memory_reserved(ctx.device)),
        "device_peak_allocated": float(torch.cuda.max_memory_allocated(ctx.device)),
    }


def count_params(parts: ModelParts, par: Parallel) -> int:
    """Parameters of the whole model: each pipeline stage counts its own (DTensor numel is the
    global size across data and tensor parallel shards)."""
    local = sum(p.numel() for p in parts.model.parameters())
    if par.dims.pp == 1:
        return local
    total = torch.tensor(float(local))
    dist.all_reduce(total, group=par.pp_group)
    return int(total.item())


@dataclass
class Job:
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
    bounds: Bounds
    state_bytes_guess: float  # per rank, before the first save measures it: fp32 + AdamW
    observe: Any  # aihpc.observe.metrics.NullMetrics | TrainMetrics
    memory: Any = None  # aihpc.resilience.memory.MemoryCheckpoint, when the tier is on
    step_times: list[float] = field(default_factory=list)  # this launch's, s


def memory_tier(spec: RunSpec, opts: TrainOptions, ctx: DistContext, par: Parallel) -> Any:
    """The in-memory peer tier when ``[checkpoint] memory_interval_steps`` is set (collective)."""
    c = spec.checkpoint
    if not c.memory_interval_steps:
        return None
    from aihpc.resilience.memory import MemoryCheckpoint

    identity = {**run_identity(spec, opts.data, opts.tokenizer), "plan": plan_summary(par)}
    return MemoryCheckpoint(opts.run_dir, identity, max_bytes=c.memory_max_GiB * 2**30)


def restore(manager: CheckpointManager, memory: Any, state: dict[str, Any]) -> tuple[int, dict]:
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
