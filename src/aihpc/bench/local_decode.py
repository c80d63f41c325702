"""What a decode step costs on a CPU host beyond GEMMs and a copy's bandwidth, measured for
``aihpc calibrate --local`` on the CPU clock (one thread's CPU time, which other jobs on a
shared host do not stretch as they stretch the wall clock):

* ``weight_stream_GBps``: the rate a one-row matrix-vector product reads its weights, over the
  spec model's own layer linears (at least 64 MiB of them, beyond any last-level cache): one
  core streams weights through its FMAs slower than it copies (this 2-core host: about 11 GB/s
  against a copy's 19);
* ``host_op_us``: one eager PyTorch op's host time (binding, dispatcher, allocator), from a
  decode step of the trainer's Llama too small for its arithmetic to count, over the ops it
  dispatches (counted with a TorchDispatchMode); the estimate prices each of a CPU step's
  counted ops with it (perf/infer/kernels.py);
* ``decode_attention_GBps``: one decode step's attention call (scaled-dot-product attention
  of one query row per sequence over a cached context, at the model's heads, KV heads and head
  dim) as the bytes of K and V per query head over time: PyTorch's CPU flash kernel walks the
  query heads and reads the K and V of each one's KV head for it, so a grouped-query cache is
  read once per query head, not once per group (its GQA loop maps query head j to KV head
  j / group); measured at the model's shape, this rate prices the kernel as it runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_DECODE_SHAPE",
    "DecodeHost",
    "DecodeShape",
    "cpu_clock",
    "decode_shape",
    "host_op_us",
    "measure_decode_host",
]

_STREAM_BYTES = 64 << 20  # beyond any last-level cache a core sees
_MAX_DIM = 8192  # a CPU host prices small models; a 70B spec's layers are measured clipped


@dataclass(frozen=True)
class DecodeShape:
    """A model's decode-step shapes: hidden size, query and KV heads, head dim, FFN width,
    layers and the context the attention call is timed over."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    layers: int
    context: int


# tiny-llama-small as benchmarks/inference_vs_measured.py sizes it
DEFAULT_DECODE_SHAPE = DecodeShape(512, 8, 4, 64, 1408, 8, 1024)


@dataclass(frozen=True)
class DecodeHost:
    weight_stream_GBps: float
    host_op_us: float
    decode_attention_GBps: float


def decode_shape(model: Any) -> DecodeShape:
    """A ModelSpec's decode shapes (its dense FFN width; the context: its sequence length, at
    most 1,024 tokens)."""
    return DecodeShape(
        model.hidden_size,
        model.num_attention_heads,
        model.kv_heads,
        model.kv_channels,
        model.ffn_hidden_size,
        model.num_layers,
        min(1024, model.seq_length),
    )


def cpu_clock() -> Callable[[], float]:
    """The CPU clock of the work torch runs here: the calling thread's CPU time at one
    intra-op thread; at n, the process's CPU time over n (every thread busy: what one of them
    takes, a loaded host's waits left out)."""
    import torch

    threads = torch.get_num_threads()
    if threads <= 1:
        return time.thread_time
    return lambda: time.process_time() / threads


def _median_s(fn: Callable[[], Any], repeats: int, clock: Callable[[], float]) -> float:
    """Median of ``repeats`` timings of ``fn`` after one warm-up (clock ticks coarser than a
    call are left out)."""
    times = []
    for i in range(repeats + 1):
        t0 = clock()
        fn()
        dt = clock() - t0
        if i and dt > 0:
            times.append(dt)
    return statistics.median(times) if times else float("inf")


def _layer_linears(shape: DecodeShape) -> list[tuple[int, int]]:
    """(in, out) of one layer's linears: Q, K, V, output; gate, up, down."""
    h, f = shape.hidden, shape.ffn
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    dims = [(h, q), (h, kv), (h, kv), (q, h), (h, f), (h, f), (f, h)]
    return [(min(a, _MAX_DIM), min(b, _MAX_DIM)) for a, b in dims]


def weight_stream_GBps(shape: DecodeShape, repeats: int, clock: Callable[[], float]) -> float:
    """One-row F.linear over the model's linears, layer after layer (repeated past
    _STREAM_BYTES), as bytes of weights over time."""
    import torch
    import torch.nn.functional as F

    per_layer = _layer_linears(shape)
    layer_bytes = sum(4 * a * b for a, b in per_layer)
    layers = max(shape.layers, -(-_STREAM_BYTES // layer_bytes))
    weights = [torch.randn(b, a) for _ in range(layers) for a, b in per_layer]
    xs = {a: torch.randn(1, a) for a, _ in per_layer}

    def run() -> None:
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    with torch.inference_mode():
        return layers * layer_bytes / _median_s(run, repeats, clock) / 1e9


def host_op_us(repeats: int, clock: Callable[[], float]) -> float:
    """One eager op's host time, microseconds: a decode step of a one-layer Llama of dim 8 and
    vocabulary 8 (its arithmetic negligible) over the aten calls it dispatches."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from aihpc.runtime import Llama, LlamaConfig

    cfg = LlamaConfig(
        dim=8, num_layers=1, num_heads=2, num_kv_heads=1, ffn_dim=8, vocab_size=8, max_seq_len=256
    )
    model = Llama(cfg)
    model.init_weights(0)
    model.eval()
    tok = torch.zeros((1, 4), dtype=torch.long)

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            Count.n += 1
            return func(*args, **(kwargs or {}))

    steps = 20
    with torch.inference_mode():
        _, cache = model.prefill(tok, capacity=4 + 1)
        with Count():
            model.decode_step(tok[:, 0], cache)
        ops = Count.n

        def run() -> None:
            _, c = model.prefill(tok, capacity=4 + steps)
            t0 = clock()
            for _ in range(steps):
                model.decode_step(tok[:, 0], c)
            run.seconds = clock() - t0  # type: ignore[attr-defined]

        times = []
        for i in range(repeats + 1):
            run()
            if i:
                times.append(run.seconds / steps)  # type: ignore[attr-defined]
    return statistics.median(times) / ops * 1e6


def decode_attention_GBps(shape: DecodeShape, repeats: int, clock: Callable[[], float]) -> float:
    """One decode step's attention calls, one per layer, each over its own cache of
    ``shape.context`` tokens for as many sequences as put the caches past _STREAM_BYTES (as a
    step's caches lie in memory, not in a last-level cache): the bytes of K and V per query
    head (fp32) over time."""
    import torch
    import torch.nn.functional as F

    h, kv, s, d = shape.heads, shape.kv_heads, shape.context, shape.head_dim
    layers = max(1, shape.layers)
    b = max(1, -(-_STREAM_BYTES // (layers * 2 * kv * s * d * 4)))
    q = torch.randn(b, h, 1, d)
    caches = [(torch.randn(b, kv, s, d), torch.randn(b, kv, s, d)) for _ in range(layers)]
    gqa = kv != h

    def run() -> None:
        for k, v in caches:
            F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)

    with torch.inference_mode():
        t = _median_s(run, repeats, clock)
    return layers * b * h * s * d * 2 * 4 / t / 1e9


def measure_decode_host(shape: DecodeShape = DEFAULT_DECODE_SHAPE, repeats: int = 5) -> DecodeHost:
    """The three decode figures of this host on the CPU clock (see the module), each the better
    of two readings, as the copy's bandwidth is taken (bench/local.py): at the process's
    intra-op threads on ``cpu_clock``, and at one thread on that thread's own CPU time. On a
    host shared with other jobs the first can read several times slow (a tiny op's fork and
    join spins on the CPU clock while its peer thread waits for a core: a CI run read 0.7 GB/s
    against ~6 quiet); one thread's own time is what the work took."""
    import torch

    def sig(x: float) -> float:
        return float(f"{x:.4g}")

    def both(measure: Callable[[Callable[[], float]], float]) -> tuple[float, float]:
        shared = measure(cpu_clock())
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            alone = measure(time.thread_time)
        finally:
            torch.set_num_threads(threads)
        return shared, alone

    return DecodeHost(
        sig(max(both(lambda c: weight_stream_GBps(shape, repeats, c)))),
        sig(min(both(lambda c: host_op_us(repeats, c)))),
        sig(max(both(lambda c: decode_attention_GBps(shape, repeats, c)))),
    )
