"""The verifiable task the repo ships for RL: two-operand integer addition with exact answers.

A problem is ``a + b`` with 0 <= a, b < ``base``; its prompt is the operands zero-padded to a
fixed width, ``"07+12="`` (every prompt the same length, so a batch of prompts and responses
needs no left padding and a plain forward computes what the KV-cache rollout computed), and its
answer the sum followed by a newline, ``"19\\n"``. Tokens are the trainer's byte tokenizer's
(runtime/data.py, vocab 256); the newline (byte 10) ends a response.

Every pair is in exactly one split: the pairs are shuffled once by ``seed`` and the first
``heldout_fraction`` of them are held out (the benchmark's accuracy is measured on them, the
policy never trains on them). The training stream is a pure function of (seed, index): prompt
``i`` of the run is the same problem whatever the world size or where a run resumed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["EOS", "AdditionTask", "exact_match"]

EOS = 10  # "\n": the end of a response


def exact_match(response: list[int], answer: list[int]) -> float:
    """1.0 when the response's tokens up to and including its first EOS are the answer's."""
    if EOS in response:
        response = response[: response.index(EOS) + 1]
    return 1.0 if response == answer else 0.0


@dataclass(frozen=True)
class AdditionTask:
    base: int = 20  # operands in [0, base)
    seed: int = 0
    heldout_fraction: float = 0.25
    _order: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.base < 2:
            raise ValueError(f"task base {self.base}: must be >= 2")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction {self.heldout_fraction}: must be in (0, 1)")
        g = torch.Generator().manual_seed(self.seed)
        object.__setattr__(self, "_order", torch.randperm(self.base**2, generator=g))

    @property
    def width(self) -> int:
        return len(str(self.base - 1))

    @property
    def prompt_len(self) -> int:
        return 2 * self.width + 2

    @property
    def max_answer_len(self) -> int:
        return len(str(2 * (self.base - 1))) + 1

    @property
    def num_heldout(self) -> int:
        return max(1, int(self.base**2 * self.heldout_fraction))

    def pair(self, index: int) -> tuple[int, int]:
        return divmod(int(self._order[index]), self.base)

    def train_pair(self, i: int) -> tuple[int, int]:
        """Training problem ``i`` (any i >= 0): the training pairs, cycled, reshuffled per epoch."""
        n_train = self.base**2 - self.num_heldout
        epoch, k = divmod(i, n_train)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch + 1)
        return self.pair(self.num_heldout + int(torch.randperm(n_train, generator=g)[k]))

    def heldout_pairs(self, n: int | None = None) -> list[tuple[int, int]]:
        count = self.num_heldout if n is None else min(n, self.num_heldout)
        return [self.pair(i) for i in range(count)]

    def prompt(self, a: int, b: int) -> list[int]:
        return list(f"{a:0{self.width}d}+{b:0{self.width}d}=".encode())

    @staticmethod
    def answer(a: int, b: int) -> list[int]:
        return list(f"{a + b}\n".encode())

    def sequence(self, a: int, b: int) -> list[int]:
        """Prompt and answer: one supervised (format) example."""
        return self.prompt(a, b) + self.answer(a, b)
