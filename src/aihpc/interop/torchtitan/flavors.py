"""What torchtitan v0.2.0 fixes for a run either way: its llama3 model flavors
(``torchtitan/models/llama3/__init__.py``, the FFN size from ffn_dim_multiplier and multiple_of
as its FeedForward computes it), its pipeline schedule names, and the [training] facts its code
decides (``FIXED``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["FIXED", "FLAVORS", "FRAMEWORK", "SCHEDULES", "VERSION", "flavor_shape"]


FRAMEWORK = "torchtitan"


VERSION = "v0.2.0"


# (dim, n_layers, n_heads, n_kv_heads, ffn_dim_multiplier, multiple_of, vocab_size)
FLAVORS: dict[str, tuple[int, int, int, int | None, float | None, int, int]] = {
    "debugmodel": (256, 6, 16, None, None, 256, 2048),
    "8B": (4096, 32, 32, 8, 1.3, 1024, 128256),
    "70B": (8192, 80, 64, 8, 1.3, 4096, 128256),
    "405B": (16384, 126, 128, 8, 1.2, 4096, 128256),
}


SCHEDULES = {"1F1B": "1f1b", "Interleaved1F1B": "interleaved-1f1b", "ZBVZeroBubble": "zbv"}


FIXED: dict[str, Any] = {
    "pipeline_split": "uneven",  # split points may leave stages a layer apart
    "attention": "flash2",  # PyTorch SDPA's flash backend
    "kv_repeat": True,  # repeat_kv ahead of SDPA
    "optimizer_dtype": "fp32",
    "grad_reduce_dtype": "fp32",  # mixed_precision_reduce: float32 is its only choice
    "grad_reduce_overlap": True,
    "fp8_saved_inputs": "bf16",  # torchao's Float8Linear keeps the 16-bit input
    "dropout": 0.0,
    "zero3_gather": "bucketed",
}


def _ffn(dim: int, multiplier: float | None, multiple_of: int) -> int:
    hidden = int(2 * 4 * dim / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * (-(-hidden // multiple_of))


def flavor_shape(flavor: str, seq_len: int) -> dict[str, Any]:
    dim, layers, heads, kv, mult, multiple, vocab = FLAVORS[flavor]
    shape = {
        "num_layers": layers,
        "hidden_size": dim,
        "num_attention_heads": heads,
        "ffn_hidden_size": _ffn(dim, mult, multiple),
        "ffn_activation": "swiglu",
        "vocab_size": vocab,
        "seq_length": seq_len,
        "tied_embeddings": False,
        "position_embedding": "rope",
        "rope_theta": 500000.0,  # every flavor's (torchtitan models/llama3/__init__.py)
    }
    if kv is not None:
        shape["num_kv_heads"] = kv
    return shape
