"""What the fresh allocations of an eager training step cost a CPU host in page faults, for
``aihpc calibrate --local`` (perf/step/page_faults.py prices them):

* ``page_fault_us``: one fresh page's cost: 64 MiB mapped privately and anonymously (as malloc
  maps) in 512 KiB pieces, one byte written in each page (the first touch faults it in and the
  kernel zeroes it), unmapped, on one thread's CPU time (which counts the kernel's work for
  the thread and not other jobs'), less the same writes to pages already present; the median
  of five;
* ``fresh_fault_fraction``: the trainer's own step (runtime/model.py's decoder at the spec's
  model and micro-batch, two micro-batches, the trainer's loss, clipping and AdamW, one
  thread) in a fresh process: its minor faults over the pages of the large fresh allocations
  ``page_faults`` counts for that step, over eight steps after two that settle glibc's
  thresholds.
"""

from __future__ import annotations

import mmap
import resource
import statistics
import time
from typing import Any

__all__ = ["MICRO_BATCHES", "fresh_fault_fraction", "page_fault_us"]

_MAP_BYTES = 64 << 20
# mapped in pieces of a trainer tensor's size (512 x 256 fp32), below a transparent huge page
_CHUNK = 512 << 10
_PAGE = 4096
_REPEATS = 5
_WARMUP_STEPS, _STEPS, MICRO_BATCHES = 2, 8, 2


def page_fault_us() -> float:
    """Microseconds of CPU time one fresh page costs: mapped, faulted in, unmapped."""
    import numpy as np

    def once() -> float:
        t0 = time.thread_time()
        private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # as malloc maps (shared ones fault slower)
        maps = [mmap.mmap(-1, _CHUNK, flags=private) for _ in range(_MAP_BYTES // _CHUNK)]
        pages = [np.frombuffer(m, dtype=np.uint8)[::_PAGE] for m in maps]
        for p in pages:  # the first touch: each page faulted in
            p[:] = 1
        t1 = time.thread_time()
        for p in pages:  # the same writes, the pages present: the loop's own cost
            p[:] = 2
        t2 = time.thread_time()
        del p, pages
        for m in maps:
            m.close()
        t3 = time.thread_time()
        return (t1 - t0) + (t3 - t2) - (t2 - t1)

    once()
    per = [once() for _ in range(_REPEATS)]
    return max(0.0, statistics.median(per)) / (_MAP_BYTES // _PAGE) * 1e6


def _worker(model: Any, micro_batch: int, out: Any) -> None:
    import torch

    from aihpc.runspec.training import TrainingSpec
    from aihpc.runtime.config import LlamaConfig
    from aihpc.runtime.job import build_optimizer
    from aihpc.runtime.model import Llama
    from aihpc.runtime.step import clip_grad_norm, token_loss

    torch.set_num_threads(1)
    cfg = LlamaConfig.from_spec(model)
    net = Llama(cfg)
    net.init_weights(0)
    opt, _ = build_optimizer(net, TrainingSpec())
    gen = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, cfg.vocab_size, (micro_batch, model.seq_length), generator=gen)
        for _ in range(MICRO_BATCHES)
    ]
    faults = []
    for step in range(_WARMUP_STEPS + _STEPS):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for x in batches:
            (token_loss(net(x), x) / MICRO_BATCHES).backward()
        clip_grad_norm(list(net.parameters()), 1.0, None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= _WARMUP_STEPS:
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    out.put(statistics.fmean(faults))


def fresh_fault_fraction(model: Any, micro_batch: int, counted_pages: float) -> float:
    """The share of a step's ``counted_pages`` (perf/step/page_faults.step_pages: the pages of
    its large fresh allocations) that fault, on the trainer's own step of ``model`` (a
    ModelSpec, dense) at ``micro_batch`` sequences a micro-batch and ``MICRO_BATCHES`` of them."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # a fresh heap: the calibration's own allocations not in it
    queue = ctx.Queue()
    proc = ctx.Process(target=_worker, args=(model, micro_batch, queue))
    proc.start()
    try:
        faults = queue.get(timeout=600)
    finally:
        proc.join(timeout=60)
    return min(1.0, faults / counted_pages)
