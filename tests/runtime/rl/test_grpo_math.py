"""GRPO's arithmetic against values worked out by hand on tiny tensors (runtime/rl/grpo.py)."""

from __future__ import annotations

import math

import torch

from aihpc.runtime.rl.grpo import (
    group_advantages,
    loo_advantages,
    policy_loss,
    response_logprobs,
)
from aihpc.runtime.rl.task import EOS, AdditionTask, exact_match


def test_group_advantages_by_hand() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    adv = group_advantages(rewards, eps=0.0 + 1e-12)
    # group 0: mean 1/2, unbiased std sqrt(4 * (1/2)^2 / 3) = sqrt(1/3)
    s0 = math.sqrt(1 / 3)
    assert torch.allclose(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / s0)
    # group 1: every sample scored the same: nothing to learn
    assert torch.equal(adv[1], torch.zeros(4))
    # group 2: mean 1/4, std sqrt((3 * 1/16 + 9/16) / 3) = 1/2
    assert torch.allclose(adv[2], torch.tensor([-0.5, -0.5, -0.5, 1.5]))


def test_leave_one_out_advantages_by_hand() -> None:
    adv = loo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 3.0]]))
    # sample 0 of group 0: 1 - mean(0, 0, 1) = 2/3; sample 1: 0 - mean(1, 0, 1) = -2/3
    assert torch.allclose(adv[0], torch.tensor([2, -2, -2, 2]) / 3)
    # group 1: the zeros see mean(0, 0, 3) = 1, the 3 sees 0
    assert torch.allclose(adv[1], torch.tensor([-1.0, -1.0, -1.0, 3.0]))


def _loss_by_hand(logp, old, ref, adv, mask, clip, beta) -> float:
    """The objective written out per token with Python floats."""
    total = 0.0
    for i in range(len(logp)):
        n = sum(mask[i])
        row = 0.0
        for t in range(len(logp[i])):
            if not mask[i][t]:
                continue
            r = math.exp(logp[i][t] - old[i][t])
            clipped = min(max(r, 1 - clip), 1 + clip)
            d = ref[i][t] - logp[i][t]
            kl = math.exp(d) - d - 1
            row += -min(r * adv[i], clipped * adv[i]) + beta * kl
        total += row / n
    return total / len(logp)


def test_policy_loss_by_hand_with_clipping_and_kl() -> None:
    # row 0: positive advantage, ratio e^0.5 = 1.65 beyond 1 + clip: clipped (no gradient);
    # row 1: negative advantage, ratio e^-0.5 below 1 - clip: min takes the clipped value too;
    # row 2: ratios inside the range; its last token is padding
    logp = [[-0.5, -1.0], [-2.0, -0.1], [-0.3, -9.0]]
    old = [[-1.0, -1.0], [-1.5, -0.2], [-0.35, -1.0]]
    ref = [[-0.7, -1.2], [-1.0, -0.1], [-0.3, -2.0]]
    adv = [1.0, -2.0, 0.5]
    mask = [[True, True], [True, True], [True, False]]
    want = _loss_by_hand(logp, old, ref, adv, mask, 0.2, 0.1)
    lp = torch.tensor(logp, requires_grad=True)
    loss, stats = policy_loss(
        lp, torch.tensor(old), torch.tensor(ref), torch.tensor(adv), torch.tensor(mask), 0.2, 0.1
    )
    assert math.isclose(float(loss.detach()), want, rel_tol=1e-6)
    assert math.isclose(stats["clip_fraction"], 2 / 5, rel_tol=1e-6)  # row 0, row 1: token 0
    loss.backward()
    # a clipped token's surrogate has no gradient: only its KL term's, beta (1 - e^d) / n / rows
    d = ref[0][0] - logp[0][0]
    assert math.isclose(float(lp.grad[0, 0]), 0.1 * (1 - math.exp(d)) / 2 / 3, rel_tol=1e-5)
    assert float(lp.grad[2, 1]) == 0.0  # padding


def test_no_reference_means_no_kl_term() -> None:
    logp = torch.tensor([[-1.0, -2.0]])
    loss, stats = policy_loss(
        logp, logp, None, torch.tensor([1.5]), torch.ones(1, 2, dtype=torch.bool), 0.2, 5.0
    )
    assert float(loss) == -1.5 and stats["kl"] == 0.0  # ratio 1: -A


def test_response_logprobs_are_the_models_next_token_probabilities() -> None:
    torch.manual_seed(0)
    vocab = 7
    table = torch.randn(vocab, vocab)

    class Bigram(torch.nn.Module):
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return table[tokens]

    prompts, responses = torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5]])
    got = response_logprobs(Bigram(), prompts, responses)
    want = [table[3].log_softmax(-1)[4], table[4].log_softmax(-1)[5]]
    assert torch.allclose(got[0], torch.stack(want))


def test_task_prompts_splits_and_reward() -> None:
    task = AdditionTask(base=20, seed=3)
    held = set(task.heldout_pairs())
    train = {task.train_pair(i) for i in range(2000)}
    assert len(held) == task.num_heldout == 100 and not held & train
    assert len(train) == 400 - 100  # every training pair comes up
    assert {len(task.prompt(a, b)) for a in range(20) for b in range(20)} == {task.prompt_len}
    assert bytes(task.sequence(7, 12)) == b"07+12=19\n"
    answer = task.answer(7, 12)
    assert exact_match(list(b"19\n"), answer) == 1.0
    assert exact_match(list(b"19\n77"), answer) == 1.0  # what follows the EOS is not read
    assert exact_match(list(b"19"), answer) == 0.0  # no EOS: not an answer
    assert exact_match(list(b"18\n"), answer) == 0.0
    assert ord("\n") == EOS
