"""The GRPO loop on one rank: the policy under the trainer's plans (one process, DDP, FSDP2 on
gloo or NCCL, tensor parallel, pipeline parallel through pipeline.py), a frozen reference, a
colocated rollout model synced in place after every update, an optional supervised warm-up on
the task's format, and exact checkpoints.

A step: this data-parallel rank's share of the step's prompts (prompts_per_step / dp, whole
groups) is rolled out with the KV cache, scored, turned into group-relative advantages; the
old-policy and reference log-probs are computed without gradients; ``ppo_epochs`` updates of
the clipped objective follow; the new weights go to the rollout model. Prompts are numbered
run-wide (step x prompts_per_step + i) and each is sampled from its own seeded generator, so the
step's data and samples are one function of (seed, step): the data cursor and the RNG state a
checkpoint needs are the step number.

Under pipeline parallel every rank of a pipeline holds the same rollout (its data-parallel
rank's), the old-policy log-probs come from the rollout model (the policy's whole weights, synced
after every update), and the update runs the pipeline schedule (pipeline.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from aihpc.runtime.config import LlamaConfig
from aihpc.runtime.distributed import DistContext
from aihpc.runtime.generate import generate
from aihpc.runtime.mesh import Parallel
from aihpc.runtime.model import Llama
from aihpc.runtime.parallelize import build_parallel_model, unwrap
from aihpc.runtime.rl.grpo import (
    group_advantages,
    loo_advantages,
    policy_loss,
    response_logprobs,
    whole_logits,
)
from aihpc.runtime.rl.pipeline import (
    gather_stages,
    merge_states,
    own_part,
    pack_grpo,
    policy_stepper,
)
from aihpc.runtime.rl.rollout import full_weights, rollout, sync_weights
from aihpc.runtime.rl.task import EOS, AdditionTask, exact_match
from aihpc.runtime.step import clip_grad_norm

__all__ = ["GRPOConfig", "GRPOTrainer"]


@dataclass(frozen=True)
class GRPOConfig:
    prompts_per_step: int
    samples_per_prompt: int
    steps: int  # GRPO steps of the run
    lr: float
    seed: int
    clip: float = 0.2  # the policy ratio's clip range (PPO's epsilon)
    kl_coef: float = 0.04  # beta of the KL term (DeepSeekMath's 0.04); 0: no reference pass
    temperature: float = 1.0
    ppo_epochs: int = 1
    algorithm: str = "grpo"  # grpo: group-normalised advantages; rloo: leave-one-out baseline
    minibatch: int = 0  # samples per optimizer step, all ranks' ([parallel].global_batch_size)
    grad_clip: float = 1.0
    sft_steps: int = 0  # supervised steps on the task's format before GRPO
    sft_batch: int = 32
    sft_lr: float = 3e-3
    task_base: int = 20
    micro_batch: int = 1  # pipeline parallel: rows per micro-batch ([parallel].micro_batch_size)


class GRPOTrainer:
    def __init__(self, cfg: LlamaConfig, g: GRPOConfig, ctx: DistContext, par: Parallel):
        self.cfg, self.g, self.ctx, self.par = cfg, g, ctx, par
        self.task = AdditionTask(base=g.task_base, seed=g.seed)
        torch.manual_seed(g.seed)
        self.parts = build_parallel_model(cfg, ctx, par, g.seed)
        self.policy = self.parts.model
        self.pipe: Any = None  # pipeline parallel: the update's PolicyStepper (first update)
        self.optimizer = torch.optim.AdamW(
            self.policy.parameters(), lr=g.lr, betas=(0.9, 0.99), weight_decay=0.0
        )
        self.reference = _plain(cfg, ctx.device)
        self.rollout_model = _plain(cfg, ctx.device)
        if g.minibatch == 0:
            self.g = g = replace(g, minibatch=g.prompts_per_step * g.samples_per_prompt)
        self.step = 0
        self.sft_done = g.sft_steps == 0
        self.pool: Any = None  # disaggregated: a pool.RolloutPool (run.py sets it)
        self.samples: dict[str, list[int]] = {}  # the last step's sample ids and versions (rank 0)
        self.sync()
        self.reference.load_state_dict(self.rollout_model.state_dict())

    @property
    def local_prompts(self) -> int:
        return self.g.prompts_per_step // self.par.dims.dp

    def rank_prompts(self) -> list[int]:
        """This rank's prompts of the step (run-wide numbers): its share of each update's
        prompts, so the ranks' k-th minibatches make the k-th update of a single process."""
        g, dp = self.g, self.par.dims.dp
        per_update = g.minibatch // g.samples_per_prompt
        share, first = per_update // dp, self.step * g.prompts_per_step
        start = first + self.par.dp_rank * share
        updates = range(g.prompts_per_step // per_update)
        return [start + k * per_update + j for k in updates for j in range(share)]

    @property
    def pp(self) -> int:
        return self.par.dims.pp

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The policy's whole weights on every rank (collective): data / tensor parallel shards
        gathered, and under pipeline parallel every stage's."""
        weights = full_weights(self.policy)
        if self.pp > 1:
            order = list(self.rollout_model.state_dict())
            weights = gather_stages(weights, self.par.pp_group, order)
        return weights

    def sync(self, weights: dict[str, torch.Tensor] | None = None) -> int:
        """Colocated weight sync: the policy's full weights into the rollout model, in place."""
        return sync_weights(self.rollout_model, weights or self.full_weights())

    def sft(self, log: Any = None) -> list[float]:
        """The supervised warm-up: cross-entropy on the answers of the task's training problems
        (the prompt tokens are context only); then the reference and rollout take its weights."""
        g, dp, rank = self.g, self.par.dims.dp, self.par.dp_rank
        opt = torch.optim.AdamW(self.policy.parameters(), lr=g.sft_lr, weight_decay=0.0)
        local, losses = g.sft_batch // dp, []
        p = self.task.prompt_len
        pipe = None
        if self.pp > 1:  # inputs padded to the GRPO inputs' width: one shape for the stages
            pipe = policy_stepper(self.parts, self.par, opt, self.ctx.device, local,
                                  g.micro_batch, g.grad_clip, kind="sft")  # fmt: skip
        for s in range(g.sft_steps):
            start = -(s + 1) * g.sft_batch + rank * local  # negative: a stream apart from GRPO's
            seqs = [self.task.sequence(*self.task.train_pair(i % (1 << 40))) for i in
                    range(start, start + local)]  # fmt: skip
            width = p + self.task.max_answer_len if pipe is not None else None
            x, y, w = (t.to(self.ctx.device) for t in _sft_batch(seqs, p, width))
            if pipe is not None:
                tokens = _sum_over_ranks(float(w.sum())) / (self.par.dims.tp * self.pp)
                pipe.sft_scale = dp * (local // g.micro_batch) / tokens
                losses.append(pipe.run(x, torch.stack([y.float(), w], dim=-1))[0])
            else:
                losses.append(self._sft_step(x, y, w, opt))
            if log is not None and (s + 1) % 50 == 0:
                log({"phase": "sft", "step": s + 1, "loss": losses[-1]})
        self.sync()
        self.reference.load_state_dict(self.rollout_model.state_dict())
        self.sft_done = True
        return losses

    def _sft_step(self, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, opt: Any) -> float:
        logits = whole_logits(self.policy(x)).float()
        # the global batch's token mean: each rank's sum over all ranks' answer tokens, times dp
        # (DDP / FSDP average the ranks' gradients); a TP group's ranks hold the same batch,
        # counted once
        tokens = _sum_over_ranks(float(w.sum())) / self.par.dims.tp
        loss = (F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none") *
                w.flatten()).sum() * self.par.dims.dp / tokens  # fmt: skip
        loss.backward()
        clip_grad_norm(list(self.policy.parameters()), self.g.grad_clip, None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return _sum_over_ranks(float(loss.detach())) / self.ctx.world_size

    def train_step(self) -> dict[str, float]:
        """One GRPO step; the step's metrics (means over every rank's samples)."""
        g = self.g
        t0 = time.perf_counter()
        indices = self.rank_prompts()
        if self.pool is None:
            ro = rollout(self.rollout_model, self.task, indices, g.samples_per_prompt, g.seed,
                         g.temperature)  # fmt: skip
            versions = torch.full((ro.rewards.numel(),), self.step)
        else:  # the pool's, generated with weights at most [rl] staleness versions old
            ro, versions, ids = self.pool.take(self.step, indices)
        t_roll = time.perf_counter()
        baseline = loo_advantages if g.algorithm == "rloo" else group_advantages
        adv = baseline(ro.rewards.view(self.local_prompts, -1)).flatten()
        with torch.no_grad():  # old log-probs: the current policy's (verl's one-step-off too)
            # under pipeline parallel its whole copy's: the rollout model, synced to it
            current = self.rollout_model if self.pp > 1 else self.policy
            old = response_logprobs(current, ro.prompts, ro.responses)
            ref = None
            if g.kl_coef > 0:
                ref = response_logprobs(self.reference, ro.prompts, ro.responses)
        t_logp = time.perf_counter()
        loss, stats, grad_norm = self._update(ro, adv, old, ref)
        t_update = time.perf_counter()
        if self.pool is None:
            synced = self.sync()
        else:
            weights = self.full_weights()
            if self.pp > 1:  # the rollout model holds the next step's old policy
                self.sync(weights)
            synced = self.pool.publish(self.step + 1, weights)
            # a TP group's (a pipeline's) samples, once: its first tensor and pipeline rank's
            mine = self.ctx.rank % self.par.dims.tp == 0 and self.par.pp_rank == 0
            self.samples = _gather_samples(ids if mine else [], versions.tolist() if mine else [])
        t_sync = time.perf_counter()
        staleness = self.step - int(versions.min())
        self.step += 1
        # the loss and its statistics: the last pipeline stage's ranks (every rank without PP)
        last = 1.0 if self.parts.last else 0.0
        sums = torch.tensor([float(ro.rewards.sum()), ro.rewards.numel(), ro.tokens,
                             last * loss, last * stats["kl"],
                             last * stats["clip_fraction"]])  # fmt: skip
        if self.ctx.world_size > 1:
            dist.all_reduce(sums)
        n, ranks = float(sums[1]), self.ctx.world_size // self.pp
        return {
            "step": self.step, "reward": float(sums[0]) / n, "response_len": float(sums[2]) / n,
            "loss": float(sums[3]) / ranks, "kl": float(sums[4]) / ranks,
            "clip_fraction": float(sums[5]) / ranks, "grad_norm": grad_norm,
            "rollout_s": t_roll - t0, "logprob_s": t_logp - t_roll,
            "update_s": t_update - t_logp, "weight_sync_s": t_sync - t_update,
            "weight_sync_bytes": synced, "staleness": staleness,
            "rollout_tokens": int(sums[2]) // (self.par.dims.tp * self.pp),  # a group's, once
        }  # fmt: skip

    def _update(self, ro: Any, adv: torch.Tensor, old: torch.Tensor, ref: Any) -> tuple:
        """ppo_epochs passes over this rank's samples, ``minibatch`` rows per optimizer step
        (its share of [parallel].global_batch_size, in order): the first minibatch's ratio is
        1, the later ones' are off the policy that sampled them and the clip holds them."""
        rows, mb = adv.shape[0], self.g.minibatch // self.par.dims.dp
        if self.pp > 1:
            return self._pipeline_update(ro, adv, old, ref, mb)
        for _ in range(self.g.ppo_epochs):
            for lo in range(0, rows, mb):
                part = slice(lo, lo + mb)
                logp = response_logprobs(self.policy, ro.prompts[part], ro.responses[part])
                loss, stats = policy_loss(
                    logp, old[part], None if ref is None else ref[part], adv[part],
                    ro.mask[part], self.g.clip, self.g.kl_coef,
                )  # fmt: skip
                loss.backward()
                grad_norm = clip_grad_norm(list(self.policy.parameters()), self.g.grad_clip, None)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach()), stats, grad_norm

    def _pipeline_update(self, ro: Any, adv: torch.Tensor, old: torch.Tensor, ref: Any,
                         mb: int) -> tuple:  # fmt: skip
        """``_update`` under pipeline parallel: each minibatch one step of the schedule."""
        g = self.g
        if self.pipe is None:
            self.pipe = policy_stepper(self.parts, self.par, self.optimizer, self.ctx.device, mb,
                                       g.micro_batch, g.grad_clip, clip=g.clip,
                                       kl_coef=g.kl_coef)  # fmt: skip
        x = torch.cat([ro.prompts, ro.responses], dim=1)[:, :-1]
        target = pack_grpo(ro.responses, ro.mask, old, ref, adv)
        for _ in range(g.ppo_epochs):
            for lo in range(0, adv.shape[0], mb):
                loss, stats = self.pipe.run(x[lo : lo + mb], target[lo : lo + mb])
        # the step's loss is already every rank's mean: counted once per last-stage rank
        return loss, stats, float(self.pipe.last_grad_norm or 0.0)

    def accuracy(self, n: int | None = None) -> float:
        """Greedy exact-answer accuracy of the policy (its copy in the rollout model, synced
        here: disaggregated runs sync their pool, not this copy) on the held-out problems."""
        self.sync()
        return heldout_accuracy(self.rollout_model, self.task, n)

    # -- checkpoints: the full state in one file, written by rank 0 (atomic rename) ----------

    def save(self, path: Path) -> None:
        model_sd, optim_sd = get_state_dict(
            self.policy, self.optimizer, options=StateDictOptions(full_state_dict=True)
        )
        if self.pp > 1:  # every stage's, so the file is one process's (any plan resumes it)
            every: list[Any] = [None] * self.pp
            mine = _to_cpu((model_sd, optim_sd))  # pickled across ranks: never a device's
            dist.all_gather_object(every, mine, group=self.par.pp_group)
            model_sd, optim_sd = merge_states(every)
        if self.ctx.is_main:
            state = {"step": self.step, "sft_done": self.sft_done, "policy": model_sd,
                     "optimizer": optim_sd, "reference": self.reference.state_dict()}  # fmt: skip
            if self.pool is not None:  # the staleness queue: owed batches' samples
                state["rollout"] = self.pool.state()
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            torch.save(state, tmp)
            os.replace(tmp, path)
        if self.ctx.world_size > 1:
            dist.barrier()

    def load(self, path: Path) -> None:
        state = torch.load(path, map_location="cpu", weights_only=True)
        model_sd, optim_sd = state["policy"], state["optimizer"]
        if self.pp > 1:  # this rank's stages' part
            own = set(unwrap(self.policy).state_dict())
            model_sd, optim_sd = own_part(model_sd, optim_sd, own.__contains__)
        set_state_dict(
            self.policy, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
            options=StateDictOptions(full_state_dict=True),
        )  # fmt: skip
        self.reference.load_state_dict(state["reference"])
        self.step, self.sft_done = int(state["step"]), bool(state["sft_done"])
        if self.pool is not None and "rollout" in state:
            self.pool.load_state(state["rollout"], self.step)
        self.sync()


@torch.no_grad()
def heldout_accuracy(model: Llama, task: AdditionTask, n: int | None = None) -> float:
    pairs = task.heldout_pairs(n)
    gen = generate(model, [task.prompt(a, b) for a, b in pairs], task.max_answer_len, eos_id=EOS)
    hits = [
        exact_match(gen.tokens[i, : int(gen.lengths[i])].tolist(), task.answer(a, b))
        for i, (a, b) in enumerate(pairs)
    ]
    return sum(hits) / len(hits)


def _plain(cfg: LlamaConfig, device: torch.device) -> Llama:
    model = Llama(cfg).to(device)
    model.init_weights(0)  # buffers; every weight is overwritten by a sync
    model.requires_grad_(False)
    return model.eval()


def _sft_batch(
    seqs: list[list[int]], prompt_len: int, width: int | None = None
) -> tuple[torch.Tensor, ...]:
    """Right-padded (to the longest, or ``width``) inputs, targets and the answer tokens'
    weights."""
    width = width or max(len(s) for s in seqs)
    t = torch.zeros((len(seqs), width), dtype=torch.int64)
    w = torch.zeros((len(seqs), width - 1))
    for i, s in enumerate(seqs):
        t[i, : len(s)] = torch.tensor(s)
        w[i, prompt_len - 1 : len(s) - 1] = 1.0
    return t[:, :-1], t[:, 1:], w


def _gather_samples(ids: list[int], versions: list[int]) -> dict[str, list[int]]:
    """Every rank's sample ids and versions, in rank order, on rank 0 (others: empty)."""
    mine = (ids, versions)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {"ids": ids, "versions": versions}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank():
        return {}
    return {"ids": [i for e in every for i in e[0]], "versions": [v for e in every for v in e[1]]}


def _sum_over_ranks(value: float) -> float:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def _to_cpu(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: _to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_to_cpu(v) for v in tree)
    return tree
