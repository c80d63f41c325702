"""nccl-tests semantics: busbw factors, size conventions, the table layout."""

from __future__ import annotations

import pytest

from aihpc.bench.collectives import (
    RowTiming,
    algbw_GBps,
    busbw_factor,
    busbw_GBps,
    element_counts,
    format_footer,
    format_row,
    parse_size,
    size_sweep,
)
from aihpc.runspec.errors import SpecError

# hand-computed from doc/PERFORMANCE.md: 2(n-1)/n, (n-1)/n, 1
HAND = {
    ("all_reduce", 2): 1.0,
    ("all_reduce", 4): 1.5,
    ("all_reduce", 8): 1.75,
    ("all_reduce", 16): 1.875,
    ("all_gather", 2): 0.5,
    ("all_gather", 8): 0.875,
    ("reduce_scatter", 4): 0.75,
    ("reduce_scatter", 16): 0.9375,
    ("all_to_all", 4): 0.75,
    ("all_to_all", 8): 0.875,
    ("broadcast", 8): 1.0,
    ("broadcast", 2): 1.0,
    ("send_recv", 2): 1.0,
    ("send_recv", 64): 1.0,
    ("all_reduce", 1): 0.0,
}


@pytest.mark.parametrize(("key", "factor"), HAND.items(), ids=[f"{c}-{n}" for c, n in HAND])
def test_busbw_factor_hand_computed(key, factor):
    assert busbw_factor(*key) == pytest.approx(factor, abs=1e-15)


def test_busbw_from_time_matches_published_row():
    # nccl-tests row "1073741824 ... 9306.7 115.37 115.37" is 2 ranks: factor 1 for all_reduce
    alg = algbw_GBps(1073741824, 9306.7)
    assert alg == pytest.approx(115.37, abs=0.005)
    assert busbw_GBps("all_reduce", 2, 1073741824, 9306.7) == pytest.approx(alg)
    # 8 GPUs: 1 GiB in 4002.27 us -> 268.28 algbw, 469.50 busbw (x 1.75)
    assert busbw_GBps("all_reduce", 8, 1 << 30, 4002.27) == pytest.approx(469.49, abs=0.01)
    # DeepSpeed's "2 x size / time" would be 536.6: not what we compute
    assert algbw_GBps(1 << 30, 4002.27) != pytest.approx(2 * (1 << 30) / 4002.27e3, rel=0.1)


def test_unknown_collective_is_spec_error():
    with pytest.raises(SpecError, match="collective"):
        busbw_factor("allreduce_fancy", 8)


def test_element_counts_whole_buffer_and_16_byte_chunks():
    # all_gather: size = full output; chunk per rank rounded down to 16 B (4 floats)
    assert element_counts("all_gather", 1000, 4, 8) == (28, 224, 28, 896)
    # reduce_scatter: size = full input
    assert element_counts("reduce_scatter", 1 << 20, 4, 8) == (262144, 32768, 32768, 1 << 20)
    # all_to_all: per-rank send buffer = n chunks
    assert element_counts("all_to_all", 4096, 2, 4) == (2048, 2048, 512, 4096)
    # all_reduce / broadcast / send_recv: the buffer itself
    assert element_counts("all_reduce", 1 << 20, 4, 8) == (262144, 262144, 262144, 1 << 20)
    assert element_counts("send_recv", 100, 8, 2) == (12, 12, 12, 96)


def test_format_row_is_nccl_tests_layout():
    row = format_row(
        1073741824,
        268435456,
        "float",
        "sum",
        -1,
        RowTiming(9306.7, 115.37, 115.37, 0),
        RowTiming(9291.5, 115.56, 115.56, 0),
    )
    want = (
        "  1073741824     268435456     float     sum      -1"
        "  9306.70  115.37  115.37       0  9291.50  115.56  115.56       0"
    )
    assert row == want
    # big times lose decimals to fit 7 characters; unchecked rows print N/A
    row = format_row(
        8589934592, 2147483648, "float", "sum", -1, RowTiming(31703.84, 270.94, 474.15, None), None
    )
    assert row.endswith("  31703.8  270.94  474.15    N/A      N/A     N/A     N/A     N/A")


def test_footer():
    text = format_footer("all_gather", 0, 101.319)
    assert "# Out of bounds values : 0 OK" in text
    assert "# Avg bus bandwidth    : 101.319" in text
    assert text.endswith("# Collective test concluded: all_gather_perf")


def test_sizes():
    assert parse_size("8M", "-b") == 8 << 20
    assert parse_size("1k", "-b") == 1024
    assert parse_size("64", "-b") == 64
    assert parse_size("1GiB", "-e") == 1 << 30
    assert size_sweep(1024, 65536, 4) == [1024, 4096, 16384, 65536]
    assert size_sweep(8, 8, 2) == [8]
    with pytest.raises(SpecError, match="-b/--minbytes"):
        size_sweep(4096, 1024, 2)
    with pytest.raises(SpecError, match="-f/--stepfactor"):
        size_sweep(1024, 4096, 1)
    with pytest.raises(SpecError, match="-e"):
        parse_size("lots", "-e/--maxbytes")
