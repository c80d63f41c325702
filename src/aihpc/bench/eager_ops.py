"""This host's time to issue one eager PyTorch op of aihpc's trainer, for ``aihpc calibrate
--local`` (``calibration.eager_op_us``: recorded beside the model's 8 us constant,
``params.host_eager_op_s``, not yet priced; runspec/calibration.py says why).

The trainer's decoder (runtime/model.py, its loss of runtime/step.py) at width 16 and 4 tokens,
where the arithmetic is nothing: one forward and backward timed on the calling thread's CPU time
(``time.thread_time``: what other processes on a shared host take is not counted), divided by
the aten ops it dispatches (counted once with a dispatch mode); the median of ``_ROUNDS`` rounds
of ``_CALLS`` calls. Measured here (2-core host, torch 2.13, 2026-12-07): 3.4 us an op.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

__all__ = ["measure_eager_op_us"]

_ROUNDS = 7
_CALLS = 10


def _decoder() -> tuple[Any, Any]:
    import torch

    from aihpc.runtime.config import LlamaConfig
    from aihpc.runtime.model import Llama

    cfg = LlamaConfig(
        dim=16, num_layers=2, num_heads=2, num_kv_heads=1, ffn_dim=32, vocab_size=256,
        max_seq_len=4,
    )  # fmt: skip
    model = Llama(cfg)
    model.init_weights(0)
    tokens = torch.randint(0, 256, (1, 4), generator=torch.Generator().manual_seed(0))
    return model, tokens


def _ops(model: Any, tokens: Any, once: Any) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    counter = Counter()
    with counter:
        once()
    return counter.ops


def measure_eager_op_us() -> float:
    """Host microseconds of CPU time per eager op of the trainer's decoder on this thread."""
    from aihpc.runtime.step import token_loss

    model, tokens = _decoder()

    def once() -> None:
        token_loss(model(tokens), tokens).backward()
        model.zero_grad(set_to_none=True)

    for _ in range(3):  # first calls: allocations, dispatch caches
        once()
    ops = _ops(model, tokens, once)
    rounds = []
    for _ in range(_ROUNDS):
        start = time.thread_time()
        for _ in range(_CALLS):
            once()
        rounds.append((time.thread_time() - start) / _CALLS)
    return statistics.median(rounds) / ops * 1e6
