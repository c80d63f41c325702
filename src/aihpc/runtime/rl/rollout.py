"""Rollout: the responses of a step's prompts from the rollout model (the trainer's Llama,
generating with its KV cache, runtime/generate.py), their rewards, and weight sync from the
policy to the rollout model.

Each prompt's group of samples is drawn from its own generator, seeded by (run seed, prompt
index in the run): a prompt's samples are the same whichever rank generates them, in a run of
one process or of many, and after a resume.

Weight sync, colocated: the rollout model lives in the training process; the policy's full
weights (gathered from FSDP shards, or DDP's replica) are copied into the rollout model's
tensors in place. Disaggregated: rollout worker processes (worker.py) run ``rollout`` one prompt
at a time, their weights broadcast over a gloo group (pool.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from aihpc.runtime.generate import generate
from aihpc.runtime.model import Llama
from aihpc.runtime.rl.task import EOS, AdditionTask, exact_match

__all__ = ["Rollout", "full_weights", "prompt_seed", "rollout", "sync_weights"]


@dataclass(frozen=True)
class Rollout:
    """``prompts`` (rows, p) each row's prompt, ``responses`` (rows, steps) right-padded with
    0, ``mask`` (rows, steps) the real tokens, ``rewards`` (rows,), ``gen_logprobs`` the
    sampler's log-probabilities (rows, steps), rows group-major."""

    prompts: torch.Tensor
    responses: torch.Tensor
    mask: torch.Tensor
    rewards: torch.Tensor
    gen_logprobs: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())


def prompt_seed(run_seed: int, index: int) -> int:
    """The sampling seed of the run's prompt ``index`` (a fixed mix, < 2**63)."""
    return (run_seed * 0x9E3779B1 + index * 0x85EBCA77 + 1) % (1 << 62)


def rollout(
    model: Llama,
    task: AdditionTask,
    indices: Sequence[int],
    samples: int,
    run_seed: int,
    temperature: float,
) -> Rollout:
    """``samples`` responses to each of the training prompts ``indices`` (run-wide numbers),
    with the KV cache, and their exact-match rewards."""
    prompts, responses, logps, rewards, lengths = [], [], [], [], []
    steps = task.max_answer_len
    for i in indices:
        a, b = task.train_pair(i)
        prompt = task.prompt(a, b)
        gen = generate(
            model, [prompt] * samples, steps, temperature=temperature,
            seed=prompt_seed(run_seed, i), eos_id=EOS,
        )  # fmt: skip
        answer = task.answer(a, b)
        for row in range(samples):
            n = int(gen.lengths[row])
            rewards.append(exact_match(gen.tokens[row, :n].tolist(), answer))
        prompts.append(torch.tensor([prompt] * samples, device=gen.tokens.device))
        responses.append(gen.tokens)
        logps.append(gen.logprobs)
        lengths.append(gen.lengths)
    resp = torch.cat(responses)
    device = resp.device  # the rollout model's: every tensor of the rollout lives there
    mask = torch.arange(steps, device=device)[None] < torch.cat(lengths)[:, None]
    resp = resp.masked_fill(~mask, 0)
    scores = torch.tensor(rewards, device=device)
    return Rollout(torch.cat(prompts), resp, mask, scores, torch.cat(logps))


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy's every weight, whole, on every rank (a collective under FSDP: call it on
    every rank), keyed as a plain Llama's state dict."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


@torch.no_grad()
def sync_weights(target: Llama, weights: dict[str, torch.Tensor]) -> int:
    """Copy ``weights`` into ``target``'s tensors in place (colocated sync); the bytes copied."""
    own = target.state_dict()
    moved = 0
    for name, value in weights.items():
        if name not in own:
            raise KeyError(f"weight sync: the rollout model has no tensor {name}")
        own[name].copy_(value)
        moved += value.numel() * value.element_size()
    return moved
