"""Count what would stop the host for the device in a block of PyTorch code, on any device.

On a GPU the host waits for the device wherever a value or a size computed there is read on
the host: ``tolist``/``item`` and the Python conversions of a tensor, and the ops whose output
size depends on the data (``nonzero``, boolean-mask indexing, ``bincount``, ``unique``, ...).
On a CPU nothing waits, so a test cannot time these; it counts them instead: the reads by
wrapping the Tensor methods, the data-sized ops with a dispatch mode that sees every aten op.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")
_DATA_SIZED = {
    "nonzero",
    "argwhere",
    "bincount",
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_consecutive",
    "unique_dim",
    "repeat_interleave",
    "_local_scalar_dense",
    "is_nonzero",
}


class _Ops(TorchDispatchMode):
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        name = func.overloadpacket.__name__
        bool_index = name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in (args[1] if len(args) > 1 and isinstance(args[1], list | tuple) else ())
        )
        if name in _DATA_SIZED or bool_index:
            self.counts[f"op:{name}"] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def host_syncs() -> Iterator[Counter]:
    """Inside: every host read of a tensor's value (``reads``) and every data-sized op
    (``op:<name>``) is counted in the Counter yielded."""
    counts: Counter = Counter()
    saved = {name: getattr(torch.Tensor, name) for name in _READS}

    def wrap(name: str, method: Any) -> Any:
        def read(self: torch.Tensor, *a: Any, **kw: Any) -> Any:
            if not getattr(read, "busy", False):  # item() inside tolist() is one read
                counts["reads"] += 1
            read.busy = True  # type: ignore[attr-defined]
            try:
                return method(self, *a, **kw)
            finally:
                read.busy = False  # type: ignore[attr-defined]

        return read

    for name, method in saved.items():
        setattr(torch.Tensor, name, wrap(name, method))
    try:
        with _Ops(counts):
            yield counts
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
