"""nccl-tests semantics, without torch: sizes, bandwidth definitions and the table layout.

Everything here follows NVIDIA/nccl-tests (``doc/PERFORMANCE.md``; ``src/<coll>.cu`` ``*GetBw`` and
``*GetCollByteCount``; ``src/util.cu`` print formats, v2.19) so that a number printed by
``aihpc bench comm`` means the same as the number an acceptance run of nccl-tests prints:

* ``size`` is the whole buffer of one rank, the larger of its send and receive buffers: the full
  gathered output for all_gather, the full input for reduce_scatter, the per-rank send buffer for
  all_to_all, the buffer for all_reduce / broadcast / send_recv.
* the per-peer chunk of all_gather, reduce_scatter and all_to_all is rounded down to 16 bytes,
  so the measured size can be slightly below the requested one (as in nccl-tests).
* ``algbw = size / time`` (decimal GB/s) and ``busbw = algbw * factor(n)`` with
  2(n-1)/n for all_reduce, (n-1)/n for all_gather, reduce_scatter and all_to_all, and 1 for
  broadcast and send/recv. busbw is the "ring-equivalent" bandwidth: NVLS, tree or SHARP
  algorithms can push it above the wire speed (nccl-tests issues #153, #274).
"""

# ruff: noqa: UP031  (printf-style on purpose: these are nccl-tests' C formats, verbatim)

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aihpc.runspec.calibration import COLLECTIVES, busbw_factor
from aihpc.runspec.errors import SpecError

__all__ = [
    "COLLECTIVES",
    "DTYPE_BYTES",
    "DTYPE_NAMES",
    "NCCL_TESTS_BINARIES",
    "REDOPS",
    "RowTiming",
    "algbw_GBps",
    "busbw_GBps",
    "busbw_factor",
    "element_counts",
    "float_str",
    "format_footer",
    "format_header",
    "format_row",
    "parse_size",
    "size_sweep",
]

# nccl-tests prints these type names; the aliases are what PyTorch users type.
DTYPE_NAMES = {
    "float": "float",
    "fp32": "float",
    "float32": "float",
    "half": "half",
    "fp16": "half",
    "float16": "half",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "double": "double",
    "fp64": "double",
    "float64": "double",
    "int32": "int32",
    "int": "int32",
    "int64": "int64",
}
DTYPE_BYTES = {"float": 4, "half": 2, "bfloat16": 2, "double": 8, "int32": 4, "int64": 8}
REDOPS = ("sum", "prod", "max", "min", "avg")
# the binary that measures each collective, for reading logs and naming things the nccl-tests way
NCCL_TESTS_BINARIES = {
    "all_reduce": "all_reduce_perf",
    "all_gather": "all_gather_perf",
    "reduce_scatter": "reduce_scatter_perf",
    "all_to_all": "alltoall_perf",
    "broadcast": "broadcast_perf",
    "send_recv": "sendrecv_perf",
}
_REDUCING = ("all_reduce", "reduce_scatter")
# The data columns of an nccl-tests table: the row's description, then out-of-place and in-place.
NCCL_TESTS_COLUMNS = (
    "size",
    "count",
    "type",
    "redop",
    "root",
    "time",
    "algbw",
    "busbw",
    "#wrong",
    "time",
    "algbw",
    "busbw",
    "#wrong",
)


def algbw_GBps(size_bytes: float, time_us: float) -> float:
    """Algorithm bandwidth: the whole-buffer size over the time of one operation, GB/s (1e9)."""
    return size_bytes / 1e9 / (time_us * 1e-6) if time_us > 0 else 0.0


def busbw_GBps(collective: str, num_ranks: int, size_bytes: float, time_us: float) -> float:
    return algbw_GBps(size_bytes, time_us) * busbw_factor(collective, num_ranks)


def element_counts(
    collective: str, size_bytes: int, elem_bytes: int, num_ranks: int
) -> tuple[int, int, int, int]:
    """``(send_count, recv_count, count_column, measured_size_bytes)`` for a requested size.

    Mirrors nccl-tests' ``*GetCollByteCount``: the per-peer chunk is rounded down to a multiple of
    16 bytes, and the printed size is max(send, recv) bytes; the count column is the per-rank
    parameter count (the chunk for all_gather / reduce_scatter / all_to_all).
    """
    count = size_bytes // elem_bytes
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        align = max(1, 16 // elem_bytes)
        chunk = (count // num_ranks) // align * align
        if collective == "all_gather":
            send, recv = chunk, chunk * num_ranks
        elif collective == "reduce_scatter":
            send, recv = chunk * num_ranks, chunk
        else:
            send = recv = chunk * num_ranks
        return send, recv, chunk, max(send, recv) * elem_bytes
    return count, count, count, count * elem_bytes


_SUFFIX = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str, flag: str) -> int:
    """A size as nccl-tests reads it: bytes with an optional binary K/M/G/T suffix (``-b 8M``)."""
    s = str(text).strip().upper().removesuffix("IB").removesuffix("B") or "0"
    unit = s[-1] if s[-1] in _SUFFIX else ""
    try:
        value = float(s[:-1] if unit else s)
    except ValueError:
        raise SpecError(
            flag, text, "a size in bytes, optionally with K, M, G (binary), e.g. 8M"
        ) from None
    if value < 0 or value != value:
        raise SpecError(flag, text, "a size >= 0")
    return int(value * _SUFFIX[unit])


def size_sweep(min_bytes: int, max_bytes: int, step_factor: int) -> list[int]:
    """Geometric sweep ``-b .. -e`` by ``-f`` as nccl-tests does (both ends included)."""
    if min_bytes <= 0:
        raise SpecError("-b/--minbytes", min_bytes, "must be > 0")
    if min_bytes > max_bytes:
        raise SpecError("-b/--minbytes", min_bytes, f"must be <= -e/--maxbytes ({max_bytes})")
    if step_factor < 2 and min_bytes != max_bytes:
        raise SpecError("-f/--stepfactor", step_factor, "must be >= 2")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        if step_factor < 2:
            break
        size *= step_factor
    return sizes


@dataclass(frozen=True)
class RowTiming:
    """One half of a table row: out-of-place or in-place."""

    time_us: float
    algbw_GBps: float
    busbw_GBps: float
    wrong: int | None  # None: not checked (nccl-tests prints N/A)


def float_str(value: float, width: int) -> str:
    # nccl-tests getFloatStr: as many decimals as fit the column, then an exponent
    for fmt in ("%*.2f", "%*.1f", "%*.0f"):
        s = fmt % (width, value)
        if len(s) <= width:
            return s
    return ("%*.1e" if width >= 7 else "%*.0e") % (width, value)


def format_header(
    collective: str,
    num_ranks: int,
    min_bytes: int,
    max_bytes: int,
    step_factor: int,
    warmup: int,
    iters: int,
    check: bool,
    devices: Sequence[str],
) -> str:
    """The nccl-tests (v2.19) header: parameters, devices, the two-level column header."""
    lines = [
        f"# Collective test starting: {NCCL_TESTS_BINARIES[collective]} (aihpc bench comm)",
        f"# nThread 1 nGpus 1 minBytes {min_bytes} maxBytes {max_bytes} step: {step_factor}(factor)"
        f" warmup iters: {warmup} iters: {iters} agg iters: 1 validation: {int(check)} graph: 0"
        " unalign: 0",
        "#",
        "# Using devices",
        *devices,
        "#",
        "# %10s  %12s  %8s  %6s  %6s           out-of-place                       "
        "in-place          " % ("", "", "", "", ""),
        "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s " % NCCL_TESTS_COLUMNS,
        "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s "
        % (
            "(B)",
            "(elements)",
            "",
            "",
            "",
            "(us)",
            "(GB/s)",
            "(GB/s)",
            "",
            "(us)",
            "(GB/s)",
            "(GB/s)",
            "",
        ),
    ]
    return "\n".join(lines)


def format_row(
    size_bytes: int,
    count: int,
    dtype: str,
    redop: str,
    root: int,
    out_of_place: RowTiming,
    in_place: RowTiming | None,
) -> str:
    """One data row, byte for byte as nccl-tests' writeBenchmarkLine* print it (an in-place half
    that does not exist is printed as N/A in each column)."""
    row = "%12li  %12li  %8s  %6s  %6s" % (size_bytes, count, dtype, redop, "%6i" % root)
    for t in (out_of_place, in_place):
        if t is None:
            row += "  %7s  %6s  %6s  %6s" % ("N/A", "N/A", "N/A", "N/A")
            continue
        body = "  %7s  %6s  %6s" % (
            float_str(t.time_us, 7),
            float_str(t.algbw_GBps, 6),
            float_str(t.busbw_GBps, 6),
        )
        body += "  %6g" % t.wrong if t.wrong is not None else "    N/A"
        row += body
    return row


def format_footer(collective: str, wrong_rows: int, avg_busbw: float) -> str:
    """nccl-tests' footer; the average is over every printed busbw, both columns."""
    return "\n".join(
        [
            "# %-20s : %d %s"
            % ("Out of bounds values", wrong_rows, "FAILED" if wrong_rows else "OK"),
            "# %-20s : %g " % ("Avg bus bandwidth", avg_busbw),
            "#",
            f"# Collective test concluded: {NCCL_TESTS_BINARIES[collective]}",
        ]
    )


def is_reducing(collective: str) -> bool:
    return collective in _REDUCING
