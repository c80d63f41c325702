"""DTensor's host cost on this machine, for ``aihpc calibrate --local`` (perf/step/dtensor_host.py
prices it under ``training.dtensor_dispatch = "eager"``).

Two measurements of aihpc's own trainer on a one-rank gloo mesh (a fresh process, so no process
group is left behind):

* ``count_trainer_ops``: how many ops dispatch through DTensor in one micro-batch's forward and
  backward of the tensor-parallel decoder (runtime/model.py under runtime/tp.py, with the loss
  parallel cross-entropy of runtime/step.py) and in one optimizer step with gradient clipping,
  counted by a dispatch mode that sees every aten op before DTensor does;
* ``measure_dtensor_op_us``: the same decoder's forward and backward timed on DTensors and on
  plain tensors, back to back, the median of the paired differences over the counted ops.
  On a one-rank mesh no collective runs, so the difference is DTensor's own host time, timed on
  the thread's CPU clock (other jobs on a shared host stretched the wall-clock figure from
  45-50 to 128-151 us an op);
* ``measure_dtensor_host``: that, and the same for the optimizer step with gradient clipping
  over the two decoders' parameters, over its counted ops (an optimizer op costs DTensor less
  than a layer's: AdamW on the trainer's tp2 parameters measured 21-25 us an op beyond the
  plain step where a layer's op measured 45-48).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["count_trainer_ops", "measure_dtensor_host", "measure_dtensor_op_us"]

# The measured decoder: two layers, one sequence; the op counts do not depend on the sizes.
_LAYERS = 2
_ROUNDS = 9
_CALLS = 4


def _config(shape: tuple[int, ...], layers: int) -> Any:
    """A runtime decoder of ``layers`` layers with the attention shape (batch, heads, kv heads,
    sequence, head dim) of the spec's model; the FFN 8/3 of the width, a 256-token vocabulary."""
    from aihpc.runtime.config import LlamaConfig

    _, heads, kv_heads, seq, head_dim = shape
    dim = heads * head_dim
    ffn = 64 * max(1, round(8 * dim / 3 / 64))
    return LlamaConfig(
        dim=dim, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, ffn_dim=ffn,
        vocab_size=256, max_seq_len=seq,
    )  # fmt: skip


def _counter() -> Any:
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        """Counts the aten ops that have a DTensor among their arguments."""

        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            if any(issubclass(t, DTensor) for t in types):
                self.ops += 1
            return func(*args, **(kwargs or {}))

    return Counter()


def _models(cfg: Any, sp: bool) -> tuple[Any, Any]:
    """(the decoder on plain tensors, the same decoder tensor-parallel on a one-rank mesh)."""
    from torch.distributed.device_mesh import init_device_mesh

    from aihpc.runtime.model import Llama
    from aihpc.runtime.tp import apply_tp

    plain, tp = Llama(cfg), Llama(cfg)
    apply_tp(tp, init_device_mesh("cpu", (1,)), sp)
    plain.init_weights(0)
    tp.init_weights(0)
    return plain, tp


def _pass(model: Any, tokens: Any, parallel: bool) -> tuple[Any, Any]:
    """(a closure running one micro-batch's forward, the loss, which the caller backpropagates)
    as the trainer runs it: the loss parallel cross-entropy on a tensor-parallel model."""
    from torch.distributed.tensor.parallel import loss_parallel

    from aihpc.runtime.step import token_loss

    ctx = loss_parallel if parallel else contextlib.nullcontext
    return ctx, lambda: token_loss(model(tokens), tokens)


def _counts(cfg: Any, sp: bool, tokens: Any) -> dict[str, int]:
    from aihpc.runspec.training import TrainingSpec
    from aihpc.runtime.job import build_optimizer
    from aihpc.runtime.step import clip_grad_norm

    _, model = _models(cfg, sp)
    opt, _ = build_optimizer(model, TrainingSpec())
    ctx, forward = _pass(model, tokens, True)
    out: dict[str, int] = {}
    for _ in range(2):  # the first step creates the optimizer's state
        fwd, bwd, step = _counter(), _counter(), _counter()
        with ctx():
            with fwd:
                loss = forward()
            with bwd:
                loss.backward()
        with step:
            clip_grad_norm(list(model.parameters()), 1.0, None)
            opt.step()
            opt.zero_grad(set_to_none=True)
        out = {"fwd": fwd.ops, "bwd": bwd.ops, "optimizer": step.ops}
    out["tensors"] = len(list(model.parameters()))
    return out


def _timing(cfg: Any, tokens: Any) -> tuple[float, int]:
    """(seconds DTensor adds to one forward and backward, ops it dispatched there)."""
    plain, tp = _models(cfg, False)
    runs = {False: _pass(plain, tokens, False), True: _pass(tp, tokens, True)}

    def once(parallel: bool) -> None:
        ctx, forward = runs[parallel]
        with ctx():
            forward().backward()

    def mean(parallel: bool) -> float:
        start = time.thread_time()
        for _ in range(_CALLS):
            once(parallel)
        return (time.thread_time() - start) / _CALLS

    for parallel in (False, True):
        once(parallel)
    # back to back, so both see the same load; the median of the paired differences (a
    # difference of two bests moved 45 -> 90 us per op between calibrations of a loaded host)
    diffs = [-mean(False) + mean(True) for _ in range(_ROUNDS)]
    counts = _counts(cfg, False, tokens)
    return statistics.median(diffs), counts["fwd"] + counts["bwd"]


def _optimizer_timing(cfg: Any, tokens: Any) -> tuple[float, int]:
    """(seconds DTensor adds to one optimizer step with gradient clipping, the DTensor ops it
    dispatched there): the trainer's AdamW and clipping over the tensor-parallel decoder's
    parameters and over the plain decoder's, back to back, the gradients kept between steps."""
    from aihpc.runspec.training import TrainingSpec
    from aihpc.runtime.job import build_optimizer
    from aihpc.runtime.step import clip_grad_norm

    plain, tp = _models(cfg, False)
    steps = {}
    for parallel, model in ((False, plain), (True, tp)):
        ctx, forward = _pass(model, tokens, parallel)
        with ctx():
            forward().backward()
        opt, _ = build_optimizer(model, TrainingSpec())
        params = list(model.parameters())

        def step(opt: Any = opt, params: list = params) -> None:
            clip_grad_norm(params, 1.0, None)
            opt.step()

        step()  # AdamW's state created
        steps[parallel] = step

    def mean(parallel: bool) -> float:
        start = time.thread_time()
        for _ in range(_CALLS):
            steps[parallel]()
        return (time.thread_time() - start) / _CALLS

    diffs = [-mean(False) + mean(True) for _ in range(_ROUNDS)]
    return statistics.median(diffs), _counts(cfg, False, tokens)["optimizer"]


def _worker(rank: int, init: str, out: str, task: str, shape: tuple[int, ...]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    try:
        tokens = torch.randint(0, 256, (1, shape[3]), generator=torch.Generator().manual_seed(0))
        if task == "count":
            result: Any = {
                f"{layers} {sp}": _counts(_config(shape, layers), sp, tokens)
                for layers in (1, 2)
                for sp in (False, True)
            }
        else:
            seconds, ops = _timing(_config(shape, _LAYERS), tokens)
            opt_s, opt_ops = _optimizer_timing(_config(shape, _LAYERS), tokens)
            result = {"op_us": max(0.0, seconds / ops * 1e6), "ops": ops,
                      "optimizer_op_us": max(0.0, opt_s / opt_ops * 1e6)}  # fmt: skip
        Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _spawn(task: str, shape: tuple[int, ...]) -> Any:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="aihpc-dtensor-") as tmp:
        init = "file://" + os.path.join(tmp, "store")
        out = os.path.join(tmp, "out.json")
        mp.spawn(_worker, args=(init, out, task, shape), nprocs=1, join=True)
        return json.loads(Path(out).read_text())


def count_trainer_ops(shape: tuple[int, ...] = (1, 4, 2, 16, 16)) -> dict[str, dict[str, int]]:
    """DTensor ops of the trainer's tensor-parallel decoder at 1 and 2 layers, without and with
    sequence parallel (keys "1 False" ...): one micro-batch's forward ("fwd") and backward
    ("bwd"), one optimizer step with clipping ("optimizer"), and the parameter tensors."""
    return _spawn("count", shape)


def measure_dtensor_op_us(shape: tuple[int, ...]) -> float:
    """Host microseconds DTensor adds to one op of the trainer's tensor-parallel decoder with
    the attention shape (batch, heads, kv heads, sequence, head dim) of the spec's model, at
    one thread (a training rank's when several share the host)."""
    return measure_dtensor_host(shape)[0]


def measure_dtensor_host(shape: tuple[int, ...]) -> tuple[float, float]:
    """(``measure_dtensor_op_us``, the microseconds DTensor adds to one op of the trainer's
    optimizer step with clipping over the same decoder's parameters), one process."""
    result = _spawn("time", shape)
    return float(result["op_us"]), float(result["optimizer_op_us"])
