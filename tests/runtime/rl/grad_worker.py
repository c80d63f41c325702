"""One GRPO minibatch's gradient under a plan, written by rank 0: run as ``python
grad_worker.py SPEC.toml OUT.pt [SPEC.toml OUT.pt ...]`` (a world of one) or under
torchrun (DDP / FSDP2 / TP / PP on gloo). Several plans run one after another in the one process
group (each with a trainer and device mesh of its own, as tests/runtime/nd_worker.py trains
plans): the interpreter, torch and the group are paid for once.
The same prompts and samples whatever the world size (runtime/rl/trainer.py, rank_prompts)."""

from __future__ import annotations

import sys

import torch
from torch.distributed.tensor import DTensor

from aihpc.runspec import RunSpec, load_runspec
from aihpc.runtime.config import LlamaConfig
from aihpc.runtime.distributed import DistContext, init_distributed
from aihpc.runtime.mesh import Parallel, ParallelDims
from aihpc.runtime.rl.grpo import group_advantages, policy_loss, response_logprobs
from aihpc.runtime.rl.pipeline import pack_grpo, policy_stepper
from aihpc.runtime.rl.rollout import rollout
from aihpc.runtime.rl.run import RunOptions, grpo_config
from aihpc.runtime.rl.trainer import GRPOTrainer


def main(pairs: list[str]) -> None:
    torch.set_num_threads(1)
    with init_distributed() as ctx:
        for spec_path, out in zip(pairs[::2], pairs[1::2], strict=True):
            one_plan(ctx, load_runspec(spec_path), out)


def one_plan(ctx: DistContext, spec: RunSpec, out: str) -> None:
    g = grpo_config(spec, RunOptions(sft_steps=20, sft_batch=8, task_base=5))
    par = Parallel(ParallelDims.from_plan(spec.plan(), ctx.world_size), "cpu")
    tr = GRPOTrainer(LlamaConfig.from_spec(spec.model), g, ctx, par)
    tr.sft()
    ro = rollout(tr.rollout_model, tr.task, tr.rank_prompts(), g.samples_per_prompt, g.seed,
                 g.temperature)  # fmt: skip
    adv = group_advantages(ro.rewards.view(-1, g.samples_per_prompt)).flatten()
    with torch.no_grad():  # the policy's (its whole copy's under pipeline parallel)
        current = tr.rollout_model if par.dims.pp > 1 else tr.policy
        old = response_logprobs(current, ro.prompts, ro.responses)
    if par.dims.pp > 1:  # the pipeline schedule, the trainer's update without its step
        x = torch.cat([ro.prompts, ro.responses], dim=1)[:, :-1]
        stepper = policy_stepper(tr.parts, par, tr.optimizer, ctx.device, x.shape[0],
                                 g.micro_batch, g.grad_clip, clip=g.clip,
                                 kl_coef=g.kl_coef)  # fmt: skip
        stepper._pipeline(x, pack_grpo(ro.responses, ro.mask, old, old + 0.1, adv))
    else:
        logp = response_logprobs(tr.policy, ro.prompts, ro.responses)
        loss, _ = policy_loss(logp, old, old + 0.1, adv, ro.mask, g.clip, g.kl_coef)
        loss.backward()
    grads = {}
    for name, p in tr.policy.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name.removeprefix("module.")] = grad.detach().clone()
    if par.dims.pp > 1:  # every stage's
        every = [None] * par.dims.pp
        torch.distributed.all_gather_object(every, grads, group=par.pp_group)
        grads = {k: v for part in every for k, v in part.items()}
    scored = ro.rewards.sum()
    if ctx.world_size > 1:
        torch.distributed.all_reduce(scored)
    if ctx.is_main:  # a TP group's (a pipeline's) ranks hold the same samples: counted once
        torch.save({"grads": grads, "rewards": float(scored) / (par.dims.tp * par.dims.pp)},
                   out)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
