"""``aihpc rl train``: a GRPO run from a run spec with ``[rl]``, on this process's world (one
process, or the ranks torchrun started), into a run directory.

What the spec decides: ``[model]`` the policy (its reference and rollout copies have its shape),
``[parallel]`` the update's plan (data parallel: one process, DDP at zero_stage 0, FSDP2 at
1-3; tensor parallel; pipeline parallel with the trainer's schedules, micro_batch_size rows per
micro-batch), ``[rl]`` prompts_per_step, samples_per_prompt, ppo_epochs, kl, placement
(colocated: the rollout model in each training process; disaggregated: ``rollout_gpus`` worker
processes, pool.py) and staleness (disaggregated: batches from weights up to that many updates old),
``[training]`` train_steps (GRPO steps), learning_rate and seed, ``[checkpoint]``
interval_steps. The task (runtime/rl/task.py) fixes the prompt and response lengths, so
``rl.prompt_len`` / ``response_len`` (the planner's) are not read. What the run knobs add
(``RunOptions``): the supervised warm-up's steps, the clip range, the KL coefficient, the
sampling temperature, the task's operand range.

The run directory: ``metrics.jsonl`` (one line per GRPO step), ``checkpoints/rl_XXXXXXXX.pt``
(the full state, a disaggregated run's staleness queue included; the newest two kept),
``summary.json``; disaggregated: ``samples.jsonl`` (each step's sample ids and their weights
versions) and ``rollout/`` (the workers' config, logs, pids and restarts). A run directory with a
checkpoint is resumed from its newest one. ``[checkpoint] memory_interval_steps`` and
``in_process_restarts`` add pre-training's in-memory snapshots and in-process restarts
(recover.py); ``RunOptions.faults`` (``--inject``) drills them.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from aihpc.runspec import RunSpec, SpecError
from aihpc.runtime.config import LlamaConfig
from aihpc.runtime.recoveries import load_record
from aihpc.runtime.rl.metrics import RLMetrics
from aihpc.runtime.rl.pool import RolloutPool
from aihpc.runtime.rl.recover import generations, memory_tier, restore, rl_state
from aihpc.runtime.rl.task import AdditionTask
from aihpc.runtime.rl.trainer import GRPOConfig, GRPOTrainer

__all__ = ["RunOptions", "check_rl_run", "grpo_config", "run_rl"]

KEEP = 2
MAX_TASK_BASE = 1000  # a million operand pairs: the split is one permutation of them


@dataclass(frozen=True)
class RunOptions:
    sft_steps: int = 0
    sft_batch: int = 32
    sft_lr: float = 3e-3
    clip: float = 0.2
    kl_coef: float = 0.04
    temperature: float = 1.0
    task_base: int = 20
    eval_prompts: int | None = None  # held-out problems for accuracy (None: all of them)
    hang_timeout_s: float = 300.0  # a GRPO step (or a save) without progress this long: a hang
    startup_timeout_s: float = 600.0  # start-up, the warm-up and the evaluations
    faults: tuple[Any, ...] = field(default=(), compare=False)  # --inject (a drill's faults)


def check_rl_run(spec: RunSpec, world_size: int, opts: RunOptions | None = None) -> None:
    """What ``aihpc rl train`` does not run, as a SpecError (one line, exit 2)."""
    rl, plan = spec.rl, spec.plan()
    if rl is None:
        raise SpecError("RUNSPEC", "no [rl]", "aihpc rl train needs an [rl] table (docs/rl.md)")
    if rl.algorithm not in ("grpo", "rloo"):
        raise SpecError(
            "rl.algorithm", rl.algorithm, "aihpc rl train runs grpo | rloo (ppo's critic: not yet)"
        )
    if rl.placement == "disaggregated":
        _check_pool(rl)
    why = {  # what the update does not split
        "cp": "a GRPO batch is a few short sequences (prompt + response): nothing to split "
        "over context-parallel ranks",
        "ep": "the policy is the trainer's dense Llama (the RL task's model has no experts)",
    }
    for axis, reason in why.items():
        value = getattr(plan, axis)
        if value > 1:
            raise SpecError(f"parallel.{axis}", value, f"must be 1 for aihpc rl train: {reason}")
    if plan.tp > 1 and plan.sequence_parallel:
        raise SpecError(
            "parallel.sequence_parallel", True, "must be false for aihpc rl train: a GRPO "
            "batch's length (prompt + response - 1) need not divide by parallel.tp",
        )  # fmt: skip
    if world_size % (plan.tp * plan.pp):
        raise SpecError("parallel", f"tp*pp = {plan.tp * plan.pp}",
                        f"must divide the {world_size} ranks")  # fmt: skip
    dp = world_size // (plan.tp * plan.pp)
    if rl.prompts_per_step % dp:
        raise SpecError(
            "rl.prompts_per_step", rl.prompts_per_step,
            f"must be a multiple of the {dp} data-parallel ranks (whole groups per rank)",
        )  # fmt: skip
    gbs = plan.global_batch_size
    whole = rl.samples_per_prompt * dp
    if gbs % whole:
        raise SpecError(
            "parallel.global_batch_size", gbs,
            f"must be a multiple of samples_per_prompt x data-parallel ranks = {whole} (each "
            "update takes whole groups, an equal share from every rank)",
        )  # fmt: skip
    if spec.model.vocab_size < 256:
        raise SpecError("model.vocab_size", spec.model.vocab_size, ">= 256 (byte tokens)")
    if plan.pp > 1:
        _check_pipeline(spec, world_size, dp, opts or RunOptions())


def _check_pipeline(spec: RunSpec, world_size: int, dp: int, opts: RunOptions) -> None:
    """Pipeline parallel: the trainer's rules for its schedules (enough micro-batches, a layer
    per stage, no tied embeddings, ...) on the update's minibatch, and the warm-up's batch in
    whole micro-batches too."""
    from aihpc.runspec.rules import trainer_plan_refusal

    plan = spec.plan()
    problem = trainer_plan_refusal(plan, spec.model, world_size, spec.parallel.dp)
    if problem is not None:
        raise problem
    if opts.sft_steps and (opts.sft_batch % (dp * plan.micro_batch_size) or
                           opts.sft_batch // (dp * plan.micro_batch_size) < plan.pp):  # fmt: skip
        raise SpecError(
            "sft_batch", opts.sft_batch, f"must be a multiple of dp x micro_batch_size = "
            f"{dp * plan.micro_batch_size}, at least pp = {plan.pp} micro-batches per rank",
        )  # fmt: skip


def _check_pool(rl: Any) -> None:
    """A disaggregated run: rl.rollout_gpus worker processes of one device each, weights
    broadcast over a process group (pool.py)."""
    for axis in ("tp", "pp", "ep"):
        value = getattr(rl.rollout, axis)
        if value > 1:
            raise SpecError(
                f"rl.rollout.{axis}", value, "aihpc rl train's rollout workers hold the whole "
                "model, one process each (rl.rollout_gpus of them); must be 1",
            )  # fmt: skip
    if rl.weight_sync == "storage":
        raise SpecError(
            "rl.weight_sync", "storage", "aihpc rl train syncs a disaggregated pool over a "
            "process group (gloo broadcast): auto | nccl",
        )  # fmt: skip


def grpo_config(spec: RunSpec, opts: RunOptions) -> GRPOConfig:
    rl, t = spec.rl, spec.training
    assert rl is not None
    if opts.sft_steps < 0:
        raise SpecError("--sft-steps", opts.sft_steps, "must be >= 0")
    if opts.sft_batch < 1:
        raise SpecError("sft_batch", opts.sft_batch, "must be >= 1")
    if not 2 <= opts.task_base <= MAX_TASK_BASE:
        raise SpecError("--task-base", opts.task_base, f"must be in [2, {MAX_TASK_BASE}]")
    if not 0 < opts.clip < 1:
        raise SpecError("--clip", opts.clip, "must be in (0, 1)")
    if opts.kl_coef < 0:
        raise SpecError("--kl-coef", opts.kl_coef, "must be >= 0")
    if opts.temperature <= 0:
        raise SpecError("--temperature", opts.temperature, "must be > 0 (the rollout samples)")
    task = AdditionTask(base=opts.task_base)
    if spec.model.seq_length < task.prompt_len + task.max_answer_len:
        raise SpecError(
            "model.seq_length", spec.model.seq_length,
            f"must hold a prompt and its answer: >= {task.prompt_len + task.max_answer_len}",
        )  # fmt: skip
    return GRPOConfig(
        prompts_per_step=rl.prompts_per_step, samples_per_prompt=rl.samples_per_prompt,
        steps=t.train_steps, lr=t.learning_rate, seed=t.seed, clip=opts.clip,
        kl_coef=opts.kl_coef if rl.kl else 0.0, temperature=opts.temperature,
        ppo_epochs=rl.ppo_epochs, algorithm=rl.algorithm, minibatch=spec.plan().global_batch_size,
        sft_steps=opts.sft_steps, sft_batch=opts.sft_batch, sft_lr=opts.sft_lr,
        task_base=opts.task_base, micro_batch=spec.plan().micro_batch_size,
    )  # fmt: skip


def run_rl(spec: RunSpec, run_dir: Path, opts: RunOptions, echo: Any = None) -> dict[str, Any]:
    """The whole run on this process's world; the summary (also written to summary.json). An
    exception restarts it in the same processes from the newest state (recover.py), up to
    ``[checkpoint] in_process_restarts`` times."""
    from aihpc.runtime.distributed import _LAUNCHER_KEYS, _restore_env, rendezvous_store

    grpo_config(spec, opts)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    limit = spec.checkpoint.in_process_limit(torch.cuda.is_available())
    before = {k: os.environ.get(k) for k in _LAUNCHER_KEYS}
    loads: list[dict[str, Any]] = []  # every load after a fault, in order
    run_dir.mkdir(parents=True, exist_ok=True)
    watchdog, hangs = _watchdog(spec, run_dir, opts, limit)
    try:
        store = rendezvous_store() if limit else None
        return generations(
            lambda gen: _generation(spec, run_dir, opts, echo, store, gen, loads, watchdog),
            limit,
            hangs,
        )
    finally:
        watchdog.stop()
        _restore_env(before)


def _watchdog(spec: RunSpec, run_dir: Path, opts: RunOptions, limit: int) -> tuple[Any, Any]:
    """This rank's heartbeat watchdog (pre-training's) and, where ``[checkpoint]
    in_process_restarts`` is set explicitly, what turns its finding into an in-process restart;
    unset, a hang ends the rank (exit 75), as pre-training's does."""
    from aihpc.resilience import Watchdog
    from aihpc.resilience.inprocess import Interrupter
    from aihpc.runtime.rl.recover import Hangs
    from aihpc.runtime.rundir import Events

    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    events = Events(run_dir / "events.jsonl", rank, attempt)
    interrupter = None
    if limit and spec.checkpoint.in_process_restarts is not None:
        interrupter = Interrupter()

    def on_stall(ev: dict[str, Any]) -> bool:
        acted = interrupter.interrupt(f"no progress for {ev['stalled_s']} s in {ev['phase']}")
        if acted:
            events("hang_interrupted", **ev)
        return acted

    watchdog = Watchdog(
        run_dir, rank, opts.hang_timeout_s, startup_timeout_s=opts.startup_timeout_s,
        attempt=attempt, on_hang=lambda ev: events(**ev),
        on_stall=on_stall if interrupter else None,
    ).start()  # fmt: skip
    hangs = Hangs(watchdog, interrupter, events, opts.startup_timeout_s) if interrupter else None
    return watchdog, hangs


def _generation(spec: RunSpec, run_dir: Path, opts: RunOptions, echo: Any, store: Any,
                generation: int, loads: list, watchdog: Any) -> dict[str, Any]:  # fmt: skip
    from aihpc.resilience import FaultInjector
    from aihpc.runtime.distributed import init_distributed
    from aihpc.runtime.mesh import Parallel, ParallelDims

    g = grpo_config(spec, opts)
    with init_distributed(store=store, generation=generation) as ctx:
        check_rl_run(spec, ctx.world_size, opts)
        par = Parallel(ParallelDims.from_plan(spec.plan(), ctx.world_size), ctx.device.type)
        cfg = LlamaConfig.from_spec(spec.model)
        trainer = GRPOTrainer(cfg, g, ctx, par)
        rl = spec.rl
        if rl.placement == "disaggregated":
            trainer.pool = RolloutPool(ctx, run_dir, rl.rollout_gpus, rl.staleness, g, cfg)
        memory = memory_tier(spec, run_dir, trainer)
        injector = FaultInjector(list(opts.faults), ctx.rank, run_dir)
        if memory is not None:
            injector.lose_node_memory = memory.drop_own
        done = False
        try:
            loop = _Loop(trainer, spec, run_dir, opts, echo if ctx.is_main else None, watchdog)
            summary = loop.run(memory, injector, generation, loads)
            done = True
            if memory is not None:
                summary["memory_checkpoint"] = memory.report()
                memory.discard()  # the run is over: its memory is freed
            return summary
        finally:
            if trainer.pool is not None:
                trainer.pool.close(kill=not done)
            if memory is not None:
                memory.close()


@dataclass
class _Loop:
    tr: GRPOTrainer
    spec: RunSpec
    run_dir: Path
    opts: RunOptions
    echo: Any
    watchdog: Any  # beats after each GRPO step; the other phases have start-up's bound

    def trim(self, step: int) -> None:
        """Rank 0: the lines of steps after ``step`` (they run again) dropped."""
        if not self.tr.ctx.is_main:
            return
        for name in ("metrics.jsonl", "samples.jsonl"):
            path = self.run_dir / name
            if path.exists():
                kept = [x for x in path.read_text().splitlines(keepends=True)
                        if x.endswith("\n") and json.loads(x)["step"] <= step]  # fmt: skip
                path.write_text("".join(kept))

    def run(self, memory: Any, injector: Any, generation: int, loads: list) -> dict[str, Any]:
        tr, opts, spec = self.tr, self.opts, self.spec
        ckpt_dir, main = self.run_dir / "checkpoints", tr.ctx.is_main
        self.watchdog.phase("load", opts.startup_timeout_s)
        got = restore(tr, memory, ckpt_dir)
        summary: dict[str, Any] = {"resumed_from": got["step"] if got["source"] else None}
        if generation:
            loads.append(load_record(got["step"], got["source"], got["from_peer"], 0, generation))
        self.trim(tr.step)
        if not tr.sft_done:
            summary["accuracy_init"] = tr.accuracy(opts.eval_prompts)
            sft = tr.sft()
            summary["sft"] = {"steps": tr.g.sft_steps, "final_loss": sft[-1]}
            tr.save(ckpt_dir / f"rl_{0:08d}.pt")
        before = tr.accuracy(opts.eval_prompts)
        if tr.pool is not None:
            tr.pool.start(tr.step, tr.full_weights())
        from aihpc.runtime.rl.observe import RLObserver  # metrics.prom with the predicted phases
        from aihpc.runtime.summary import device_label

        exporter = RLObserver(RLMetrics(self.run_dir), spec, tr.ctx.world_size,
                              device_label(tr.ctx.device), tr.task) if main else None  # fmt: skip
        self.watchdog.phase("first step", opts.startup_timeout_s)
        while tr.step < tr.g.steps:
            self.step(exporter, memory)
            self.watchdog.beat(tr.step)
            injector.fire(tr.step, "step")  # a drill's fault, after the step and its saves
        self.watchdog.phase("final", opts.startup_timeout_s)
        summary |= {
            "steps": tr.step, "world_size": tr.ctx.world_size, "config": asdict(tr.g),
            "placement": spec.rl.placement,
            "rollout_workers": spec.rl.rollout_gpus if tr.pool else 0,
            "staleness": spec.rl.staleness, "pool_restarts": tr.pool.restarts if tr.pool else 0,
            "accuracy_before": before, "accuracy_after": tr.accuracy(opts.eval_prompts),
            "heldout_prompts": len(tr.task.heldout_pairs(opts.eval_prompts)),
            "in_process_restarts": generation, "recoveries": loads,
        }  # fmt: skip
        if exporter is not None:  # the phases measured beside aihpc rl estimate's (observe.py)
            summary["performance"] = exporter.summary()
        if main:
            tmp = self.run_dir / "summary.json.tmp"
            tmp.write_text(json.dumps(summary, indent=1) + "\n")
            os.replace(tmp, self.run_dir / "summary.json")
        return summary

    def step(self, exporter: Any, memory: Any) -> None:
        """One GRPO step, its lines, its checkpoint file and memory snapshot when due."""
        tr, run_dir, spec = self.tr, self.run_dir, self.spec
        ckpt_dir, main = run_dir / "checkpoints", tr.ctx.is_main
        m = tr.train_step()
        if exporter is not None:
            exporter.record(m)
        if main:
            with (run_dir / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(m) + "\n")
            if tr.samples:  # disaggregated: which samples the step trained on, their versions
                with (run_dir / "samples.jsonl").open("a") as f:
                    f.write(json.dumps({"step": tr.step, **tr.samples}) + "\n")
        if self.echo is not None:
            self.echo(m)
        interval = spec.checkpoint.interval_steps or tr.g.steps
        if tr.step % interval == 0 or tr.step == tr.g.steps:
            tr.save(ckpt_dir / f"rl_{tr.step:08d}.pt")
            if main:
                for old in sorted(ckpt_dir.glob("rl_*.pt"))[:-KEEP]:
                    old.unlink()
        if memory is not None and tr.step % spec.checkpoint.memory_interval_steps == 0:
            memory.snapshot(tr.step, rl_state(tr))
