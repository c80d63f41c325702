"""Spawned workers for tests/perf/test_page_faults.py: the minor faults of the trainer's own
decoder and step, on a process started with glibc's mmap threshold fixed (the test sets
MALLOC_MMAP_THRESHOLD_ before spawning), so that every large allocation faults in its pages."""

from __future__ import annotations

import resource
from typing import Any

import torch

SEQ, VOCAB = 128, 256


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def decoder_faults(shapes: list[tuple[int, ...]]) -> dict[tuple[int, ...], tuple[int, int]]:
    """{(layers, batch, dim, heads, kv heads, ffn): (forward faults, backward faults)} of the
    trainer's decoder with its loss (runtime/model.py, runtime/step.py), the fourth pass (the
    first ones settle the process: imports, the weights' first gradients)."""
    from aihpc.runtime.config import LlamaConfig
    from aihpc.runtime.model import Llama
    from aihpc.runtime.step import token_loss

    torch.set_num_threads(1)
    out = {}
    for layers, batch, dim, heads, kv, ffn in shapes:
        cfg = LlamaConfig(
            dim=dim, num_layers=layers, num_heads=heads, num_kv_heads=kv, ffn_dim=ffn,
            vocab_size=VOCAB, max_seq_len=SEQ,
        )  # fmt: skip
        model = Llama(cfg)
        model.init_weights(0)
        tokens = torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(0))
        for _ in range(4):
            f0 = _faults()
            loss = token_loss(model(tokens), tokens)
            f1 = _faults()
            loss.backward()
            f2 = _faults()
            model.zero_grad(set_to_none=True)
        out[(layers, batch, dim, heads, kv, ffn)] = (f1 - f0, f2 - f1)
    return out


def trainer_step_faults(parallel: dict[str, Any], steps: int) -> list[int]:
    """The minor faults of each of ``steps`` steps of `aihpc train`'s stepper (runtime/job.py
    build, runtime/step.py) on one rank, tiny-llama-small, after two that settle it."""
    import tempfile
    from contextlib import nullcontext
    from pathlib import Path

    from aihpc.bench.dist import init_distributed
    from aihpc.runspec import runspec_from_dict
    from aihpc.runtime.job import TrainOptions, build

    torch.set_num_threads(1)
    with init_distributed(120.0) as ctx, tempfile.TemporaryDirectory() as tmp:
        spec = runspec_from_dict(
            {
                "model": {"preset": "tiny-llama-small"},
                "cluster": {"num_gpus": 1, "gpus_per_node": 1, "gpu": "h100-sxm"},
                "parallel": parallel,
            }
        )
        _, _, stepper, _ = build(spec, TrainOptions(run_dir=Path(tmp) / "run"), ctx)
        out = []
        for i in range(2 + steps):
            f0 = _faults()
            stepper.step(nullcontext())
            if i >= 2:
                out.append(_faults() - f0)
    return out
