"""Page faults of the fresh allocations an eager step makes on a CPU host, in bytes and seconds.

PyTorch's CPU allocator caches nothing: every tensor an op returns is a fresh ``malloc`` and
goes back to glibc when freed. glibc serves a request at or above its mmap threshold (128 KiB by
default) from pages the kernel maps afresh, which are faulted in (and zeroed) on first touch,
or from heap the allocator may have handed back to the kernel (``free`` trims the heap's top
once it exceeds the trim threshold): either way the page costs a minor fault. With the
threshold fixed (``MALLOC_MMAP_THRESHOLD_`` set), every such allocation faults in every page,
and a step's minor faults (``getrusage``'s ``ru_minflt``) are its large allocations' pages, to
within 1% on the trainer (``tests/perf/test_page_faults.py``). With glibc's default dynamic
thresholds (raised to the largest freed mapping after the first step), only a share of those
pages are faulted again in a later step: the ones the trimmed heap must regrow. That share is a
property of the allocator on this host and of the step's allocation order; ``aihpc calibrate
--local`` measures it on the trainer's own model and step (``gpu_spec.fresh_fault_fraction``),
and one fault's cost (``gpu_spec.page_fault_us``: map, touch and unmap a page, on CPU time).
Without both figures (every GPU) the term is zero.

The bytes are counted, not fitted: the fp32 tensors of at least ``THRESHOLD_BYTES`` that the
trainer's dense decoder layer (runtime/model.py), its outside (embedding, final norm, output
layer, loss) and its AdamW step return, counted with a dispatch mode at one and two layers
(torch 2.13), by width per token row: the residual stream (``h``), the query heads' (``q``,
heads x head dim; ``q_half``: RoPE's halves), the KV heads' (``kv``, ``kv_half``), the FFN's
(``f``) and the vocabulary's (``v``); plus a fresh gradient per parameter matrix per
micro-batch and AdamW's two temporaries (``sqrt``, ``div``) per parameter tensor per step.
"""

from __future__ import annotations

from typing import Any

from aihpc.perf.step.numeric import where
from aihpc.runspec.cluster import GPUSpec
from aihpc.runspec.model import ModelSpec

__all__ = [
    "LAYER_TENSORS",
    "OPTIMIZER_TEMPORARIES",
    "OUTSIDE_TENSORS",
    "PAGE_BYTES",
    "THRESHOLD_BYTES",
    "fault_time_s",
    "layer_bytes",
    "matrix_bytes",
    "optimizer_bytes",
    "outside_bytes",
    "priced",
    "step_pages",
]

THRESHOLD_BYTES = 128 * 1024  # glibc's default M_MMAP_THRESHOLD
PAGE_BYTES = 4096
FP32 = 4
# One dense layer and micro-batch: (forward, backward) fresh tensors of token rows by width.
# Forward: the norms' pow and multiplies, the residual adds, wo's and w2's outputs (h); the q
# projection, its RoPE stack, the transposed copy, the attention output (q); RoPE's products,
# sums and differences on each half (q_half, kv_half); k and v projections and k's RoPE stack
# (kv); w1's and w3's outputs, SiLU and the product (f). Backward: their gradients, less the
# sums of a tensor's gradients that autograd's engine makes in place into the first one (a
# dispatch mode sees them as fresh ``add`` outputs; the faults say they are not: 28 - 5 h,
# 6 - 1 q, 7 - 1 q_half, 6 - 1 kv, 7 - 2 kv_half; checked on the minor faults of the
# trainer's decoder at two widths and two KV widths, tests/perf/test_page_faults.py).
LAYER_TENSORS = {
    "h": (10, 23),
    "q": (4, 5),
    "q_half": (6, 6),
    "kv": (3, 5),
    "kv_half": (6, 5),
    "f": (4, 4),
}
# The embedding, final norm, output layer and loss, one micro-batch: (forward, backward); the
# backward's 10 h less one sum in place.
OUTSIDE_TENSORS = {"h": (4, 9), "v": (2, 2)}
# AdamW's single-tensor step on a CPU: ``exp_avg_sq.sqrt()`` and its division, per tensor.
OPTIMIZER_TEMPORARIES = 2


def priced(gpu: GPUSpec) -> bool:
    """Whether the host measured what a fault costs (``calibrate --local`` on a CPU)."""
    return (
        gpu.host_is_device
        and gpu.page_fault_us is not None
        and gpu.fresh_fault_fraction is not None
    )


def _large(rows: Any, width: Any) -> Any:
    """Bytes of one fp32 tensor of ``rows`` x ``width``, if glibc maps it (else 0)."""
    b = FP32 * rows * width
    return where(b >= THRESHOLD_BYTES, b, 0.0)


def _widths(model: ModelSpec, tp: Any) -> dict[str, Any]:
    q = model.num_attention_heads * model.kv_channels / tp
    kv = model.kv_heads * model.kv_channels / tp
    f = model.ffn_hidden_size / tp
    return {"h": model.hidden_size, "q": q, "q_half": q / 2, "kv": kv, "kv_half": kv / 2, "f": f}


def layer_bytes(model: ModelSpec, tokens: Any, tp: Any = 1, sp: Any = False) -> tuple[Any, Any]:
    """(forward, backward) bytes of a dense layer's fresh large tensors, one micro-batch of
    ``tokens`` rows on the rank (its CP share), the heads and FFN split over ``tp`` and, with
    sequence parallel, the residual stream's rows too; plus the backward's fresh gradient of
    each of the layer's weight matrices (``matrix_bytes``)."""
    widths = _widths(model, tp)
    fwd = bwd = 0.0
    for kind, (nf, nb) in LAYER_TENSORS.items():
        rows = where(sp, tokens / tp, tokens) if kind == "h" else tokens
        one = _large(rows, widths[kind])
        fwd, bwd = fwd + nf * one, bwd + nb * one
    return fwd, bwd + matrix_bytes(model, tp)


def matrix_bytes(model: ModelSpec, tp: Any = 1, shard: Any = 1) -> Any:
    """Bytes of a dense layer's weight matrices that glibc maps, each split over ``tp`` and
    sharded over ``shard`` ranks (q, k, v, o, w1, w3, w2)."""
    w = _widths(model, tp)
    h = model.hidden_size / shard
    return 2 * _large(h, w["q"]) + 2 * _large(h, w["kv"]) + 3 * _large(h, w["f"])


def outside_bytes(model: ModelSpec, tokens: Any, tp: Any = 1) -> tuple[Any, Any]:
    """(forward, backward) of the embedding, final norm, output layer and loss, one
    micro-batch, with the output layer's (and embedding's) fresh weight gradients."""
    h, v = model.hidden_size, model.vocab_size / tp
    nh, nv = OUTSIDE_TENSORS["h"], OUTSIDE_TENSORS["v"]
    one_h, one_v = _large(tokens, h), _large(tokens, v)
    tables = (1 if model.tied_embeddings else 2) * _large(v, h)
    return nh[0] * one_h + nv[0] * one_v, nh[1] * one_h + nv[1] * one_v + tables


def optimizer_bytes(model: ModelSpec, layers: Any, tp: Any = 1, shard: Any = 1) -> Any:
    """AdamW's temporaries over the stage's weight matrices (their ZeRO shard) in one step."""
    tables = (1 if model.tied_embeddings else 2) * _large(
        model.vocab_size / tp / shard, model.hidden_size
    )
    return OPTIMIZER_TEMPORARIES * (layers * matrix_bytes(model, tp, shard) + tables)


def fault_time_s(num_bytes: Any, gpu: GPUSpec) -> Any:
    """Seconds the faults of ``num_bytes`` of fresh large allocations cost on this host: the
    share of their pages faulted again (``fresh_fault_fraction``) at ``page_fault_us``; 0
    where the host did not measure them."""
    if not priced(gpu):
        return 0.0 * num_bytes
    pages = num_bytes / PAGE_BYTES
    return pages * gpu.fresh_fault_fraction * gpu.page_fault_us * 1e-6


def step_pages(model: ModelSpec, tokens: int, micro_batches: int) -> float:
    """Pages of the large fresh allocations of one step of one rank holding the whole dense
    ``model`` (no parallelism): ``micro_batches`` micro-batches of ``tokens`` rows, then AdamW."""
    fwd, bwd = layer_bytes(model, tokens)
    out_f, out_b = outside_bytes(model, tokens)
    per_mb = model.num_layers * (fwd + bwd) + out_f + out_b
    return (micro_batches * per_mb + optimizer_bytes(model, model.num_layers)) / PAGE_BYTES
