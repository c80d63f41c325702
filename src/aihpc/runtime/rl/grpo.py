"""GRPO's arithmetic (Shao et al. 2024, DeepSeekMath §4.1): group-relative advantages, the
clipped policy-ratio loss with a KL term to a frozen reference, and the log-probabilities of a
batch of responses under a model.

Shapes: a batch holds ``groups`` prompts x ``samples`` responses, flattened group-major to
``rows = groups * samples``; responses are right-padded to ``steps`` tokens and ``mask``
(rows, steps) marks each one's real tokens (its EOS included).

    adv = group_advantages(rewards.view(groups, samples)).flatten()
    loss, stats = policy_loss(logp, old_logp, ref_logp, adv, mask, clip=0.2, kl_coef=0.04)
"""

from __future__ import annotations

import torch

__all__ = [
    "group_advantages",
    "loo_advantages",
    "policy_loss",
    "response_logprobs",
    "whole_logits",
]


def whole_logits(logits: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel policy's logits are sharded over the vocabulary (a DTensor, ready for
    loss parallel): gathered whole here (differentiably), as the per-token log-probabilities of
    sampled tokens need every vocabulary entry's logit. Plain tensors pass through."""
    full = getattr(logits, "full_tensor", None)
    return full() if full is not None else logits


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rewards (groups, samples) → each sample's reward less its group's mean, over the group's
    standard deviation (unbiased, as DeepSeekMath's outcome supervision), ``eps`` added. A group
    whose samples all scored the same has advantages 0: it teaches nothing."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)
    return (rewards - mean) / (std + eps)


def loo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): rewards (groups, samples) → each sample's reward less the
    mean of the other samples of its group, (G r_i - sum_j r_j) / (G - 1); no normalisation."""
    g = rewards.shape[1]
    return (g * rewards - rewards.sum(dim=1, keepdim=True)) / (g - 1)


def response_logprobs(
    model: torch.nn.Module, prompts: torch.Tensor, responses: torch.Tensor
) -> torch.Tensor:
    """prompts (rows, p), responses (rows, steps) → (rows, steps) the log-probability of each
    response token given the prompt and the tokens before it (padding positions too: mask them)."""
    seq = torch.cat([prompts, responses], dim=1)
    logits = whole_logits(model(seq[:, :-1])).float()
    p = prompts.shape[1]
    logits = logits[:, p - 1 :]
    return logits.log_softmax(-1).gather(-1, responses[..., None])[..., 0]


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    kl_coef: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The GRPO objective, negated to minimise: for each response i and its tokens t,

        l_it = -min(r_it A_i, clip(r_it, 1 - clip, 1 + clip) A_i) + kl_coef KL_it
        r_it = exp(logp_it - old_logp_it)
        KL_it = exp(ref_it - logp_it) - (ref_it - logp_it) - 1   (Schulman's k3, >= 0)

    averaged over each response's tokens, then over the responses (DeepSeekMath's
    1/G sum_i 1/|o_i| sum_t). Each data-parallel rank holds the same number of responses, so
    the mean of the ranks' losses (DDP / FSDP average the gradients) is the global one.
    ``ref_logp`` None: no KL term. Returns the loss and (detached) statistics."""
    m = mask.float()
    lengths = m.sum(dim=1).clamp(min=1.0)
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    per_token = -surrogate
    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        delta = ref_logp - logp
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + kl_coef * kl
    loss = ((per_token * m).sum(dim=1) / lengths).mean()
    clipped = ((ratio - 1).abs() > clip).float()
    stats = {
        "kl": float(((kl.detach() * m).sum(dim=1) / lengths).mean()),
        "clip_fraction": float((clipped.detach() * m).sum() / m.sum().clamp(min=1.0)),
    }
    return loss, stats
