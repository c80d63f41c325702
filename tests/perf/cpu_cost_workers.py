"""Spawned workers for tests/perf/test_trainer_cpu_costs.py: what the trainer's ring attention
issues and moves on a CPU, counted on real gloo processes (no mocks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from aihpc.bench.dist import init_distributed
from aihpc.comm.ring import load_balanced_layout, ring_attention

# ops that move no element-wise bytes the model prices with the ring: its GEMMs (priced as
# the unfused attention's batched GEMMs) and views
NOT_STREAMED = {
    "mm", "bmm", "matmul", "addmm", "baddbmm", "_unsafe_view", "view", "t", "transpose",
    "expand", "unsqueeze", "select", "slice", "reshape", "permute", "as_strided", "alias",
    "_reshape_alias", "detach", "split", "unbind", "squeeze",
}  # fmt: skip


class Counter(TorchDispatchMode):
    """Every aten op, and the bytes of the tensors each element-wise op reads and writes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        if func.__name__.split(".")[0] not in NOT_STREAMED:
            flat = tree_flatten((args, kwargs, out))[0]
            self.bytes += sum(t.numel() * t.element_size() for t in flat if torch.is_tensor(t))
        return out


def ring_counts(shape: tuple[int, int, int, int, int]) -> dict[int, dict[str, int]]:
    """{cp: ops and bytes of one ring attention forward and backward} at cp 1 (each rank alone)
    and cp 2, fp32, for (batch, heads, kv_heads, seq, head_dim); rank 0's."""
    b, h, kvh, seq, d = shape
    out = {}
    with init_distributed(60.0) as ctx:
        singles = [dist.new_group([r]) for r in range(ctx.world_size)]
        for cp, group in ((1, singles[ctx.rank]), (2, dist.group.WORLD)):
            local = seq // cp
            gen = torch.Generator().manual_seed(ctx.rank)
            q = torch.randn(b, h, local, d, generator=gen, requires_grad=True)
            k = torch.randn(b, kvh, local, d, generator=gen, requires_grad=True)
            v = torch.randn(b, kvh, local, d, generator=gen, requires_grad=True)
            dout = torch.randn(b, h, local, d, generator=gen)
            layout = load_balanced_layout(seq, cp)  # the trainer builds it once, outside
            fwd, bwd = Counter(), Counter()
            with fwd:
                o = ring_attention(q, k, v, group=group, positions=layout)
            with bwd:
                o.backward(dout)
            out[cp] = {"fwd_ops": fwd.ops, "bwd_ops": bwd.ops, "fwd_bytes": fwd.bytes,
                       "bwd_bytes": bwd.bytes}  # fmt: skip
    return out


class FSDPCopies(TorchDispatchMode):
    """FSDP2's collectives and the bytes its copies around them read and write (every tensor
    an op takes or writes into: the shards in and the gathered buffer; the buffer out and the
    unsharded parameters; the gradients in and the reduce-scatter's input; the shard copy's
    source and destination)."""

    COPIES = ("all_gather_copy_in", "split_with_sizes_copy", "_chunk_cat", "chunk_cat", "copy_")

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        self.ops[name] = self.ops.get(name, 0) + 1
        if name == "all_gather_copy_in":  # the shards read, and written into the input buffer
            self.bytes += 2 * sum(t.numel() * t.element_size() for t in args[0])
        elif name in self.COPIES:  # source(s) and destination(s)
            flat = tree_flatten((args, kwargs))[0]
            self.bytes += sum(t.numel() * t.element_size() for t in flat if torch.is_tensor(t))
        return out


def fsdp_counts(zeros: tuple[int, ...], micro_batches: int) -> dict[int, dict[str, Any]]:
    """{zero: one forward-backward of the trainer's step (runtime/step.py) at that ZeRO stage on
    this rank's ``micro_batches`` micro-batches of tiny-llama-small: FSDP2's collectives and
    copy bytes, the unsharded parameters' bytes, the layers}; rank 0's."""
    import tempfile
    from contextlib import nullcontext
    from pathlib import Path

    from aihpc.runspec import runspec_from_dict
    from aihpc.runtime.job import TrainOptions, build

    out = {}
    with init_distributed(120.0) as ctx, tempfile.TemporaryDirectory() as tmp:
        for zero in zeros:
            parallel = {"global_batch_size": 4 * micro_batches, "micro_batch_size": 2}
            spec = runspec_from_dict(
                {
                    "model": {"preset": "tiny-llama-small"},
                    "cluster": {"num_gpus": 2, "gpus_per_node": 2, "gpu": "h100-sxm"},
                    "parallel": {**parallel, "zero_stage": zero},
                }
            )
            _, parts, stepper, _ = build(spec, TrainOptions(run_dir=Path(tmp) / str(zero)), ctx)
            stepper.step(nullcontext())  # the first step's lazy initialisation not counted
            x, y = stepper._batch()
            mode = FSDPCopies()
            with mode:
                stepper._forward_backward(x, y, nullcontext())
            full = sum(p.numel() * p.element_size() for p in parts.model.parameters())
            layers = len(parts.model.layers)
            out[zero] = {
                "ops": mode.ops,
                "bytes": mode.bytes,
                "param_bytes": full,
                "layers": layers,
            }
    return out


class GradCopies(TorchDispatchMode):
    """The ops that write or read a whole tensor into or out of another: ``copy_`` (its
    destination's address and bytes) and out= variants (``mul`` with ``out``: its input's
    address and the output's bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.__name__.split(".")[0]
        if name == "copy_":
            dst = args[0]
            self.copies.append(("copy_", dst.data_ptr(), dst.numel() * dst.element_size()))
        elif "out" in kwargs and torch.is_tensor(args[0]):
            dst = kwargs["out"]
            self.copies.append((name, args[0].data_ptr(), dst.numel() * dst.element_size()))
        return out


def ddp_copies(micro_batches: int) -> dict[str, Any]:
    """One forward-backward of the trainer's step (runtime/step.py) under DDP (ZeRO 0, data
    parallel only) on ``micro_batches`` micro-batches of tiny-llama-small: the bytes of the
    copies into a gradient (``copy_`` whose destination is a parameter's gradient: DDP's
    reducer copying the all-reduced bucket back) and out of one (an out= op whose input is a
    gradient: the reducer's copy into its bucket, divided by the ranks on the way), and the
    parameters' count and bytes; rank 0's."""
    import tempfile
    from contextlib import nullcontext
    from pathlib import Path

    from aihpc.runspec import runspec_from_dict
    from aihpc.runtime.job import TrainOptions, build

    with init_distributed(120.0) as ctx, tempfile.TemporaryDirectory() as tmp:
        parallel = {"global_batch_size": 4 * micro_batches, "micro_batch_size": 2}
        spec = runspec_from_dict(
            {
                "model": {"preset": "tiny-llama-small"},
                "cluster": {"num_gpus": 2, "gpus_per_node": 2, "gpu": "h100-sxm"},
                "parallel": {**parallel, "zero_stage": 0},
            }
        )
        _, parts, stepper, _ = build(spec, TrainOptions(run_dir=Path(tmp) / "ddp"), ctx)
        stepper.step(nullcontext())  # the first step's lazy initialisation not counted
        x, y = stepper._batch()
        mode = GradCopies()
        with mode:
            stepper._forward_backward(x, y, nullcontext())
        params = list(parts.model.parameters())
        grads = {p.grad.data_ptr() for p in params}
        into = [b for name, ptr, b in mode.copies if name == "copy_" and ptr in grads]
        out_of = [b for name, ptr, b in mode.copies if name != "copy_" and ptr in grads]
        return {"into": into, "out_of": out_of, "tensors": len(params),
                "param_bytes": sum(p.numel() * p.element_size() for p in params),
                "ddp": type(parts.model).__name__}  # fmt: skip
