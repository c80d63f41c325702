"""The nccl-tests log parser on samples in nccl-tests' exact format (see data/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aihpc.bench.nccl_log import parse_nccl_tests, read_nccl_tests_log
from aihpc.runspec.errors import SpecError

DATA = Path(__file__).parent / "data"
ONE_NODE = DATA / "all_reduce_perf_8xH100_1node.txt"
TWO_NODES_AR = DATA / "all_reduce_perf_2x8xH100_ib.txt"
TWO_NODES_AG = DATA / "all_gather_perf_2x8xH100_ib.txt"


def test_single_node_new_layout():
    (t,) = read_nccl_tests_log(ONE_NODE)
    assert t.collective == "all_reduce"  # from "# Collective test starting: all_reduce_perf"
    assert t.num_ranks == 8
    assert t.hosts == ["dgx-h100-017"]
    assert t.ranks[3] == (3, "dgx-h100-017", "NVIDIA H100 80GB HBM3")
    assert len(t.rows) == 31  # 8 B .. 8 GiB, factor 2
    first, last = t.rows[0], t.rows[-1]
    assert (first.size_bytes, first.count, first.dtype, first.redop, first.root) == (
        8,
        2,
        "float",
        "sum",
        -1,
    )
    # the last row as printed: 31703.8 270.94 474.15 0 | 31253.6 274.85 480.98 0
    assert last.size_bytes == 8589934592
    assert last.out_of_place == (31703.8, 270.94, 474.15, 0)
    assert last.in_place == (31253.6, 274.85, 480.98, 0)
    assert t.out_of_bounds == 0


@pytest.mark.parametrize("path", [ONE_NODE, TWO_NODES_AR, TWO_NODES_AG])
def test_avg_bus_bandwidth_is_mean_of_both_column_groups(path):
    (t,) = read_nccl_tests_log(path)
    # nccl-tests averages every printed busbw, out-of-place and in-place; the footer only
    # matches when both groups of every row were read (printed values are rounded to 0.01)
    assert t.avg_busbw_GBps is not None
    assert t.mean_busbw() == pytest.approx(t.avg_busbw_GBps, abs=0.01)
    oop_only = sum(r.out_of_place[2] for r in t.rows) / len(t.rows)
    assert oop_only != pytest.approx(t.avg_busbw_GBps, abs=0.01)


def test_multi_node_old_layout():
    (t,) = read_nccl_tests_log(TWO_NODES_AR)
    assert t.collective == "all_reduce"  # old builds do not say: taken from the file name
    assert t.num_ranks == 16
    assert t.hosts == ["gpu-node-101", "gpu-node-102"]
    assert [r[0] for r in t.ranks] == list(range(16))
    assert len(t.rows) == 31
    big = t.rows[-1]
    assert big.out_of_place[3] == 0 and big.in_place is not None
    assert 340 < big.out_of_place[2] < 380  # ~8 NDR NICs


def test_unchecked_rows_have_no_wrong_count():
    (t,) = read_nccl_tests_log(TWO_NODES_AG)
    assert t.collective == "all_gather"
    assert t.rows[0].redop == "none"
    assert all(r.out_of_place[3] is None and r.in_place[3] is None for r in t.rows)
    # all_gather's size is the gathered output: per-rank count x 16 ranks x 4 bytes
    assert all(r.size_bytes == r.count * 16 * 4 for r in t.rows)


def test_several_tests_in_one_text_and_launcher_noise():
    text = ONE_NODE.read_text().replace("all_reduce_perf", "reduce_scatter_perf")
    text = "srun: job 1234 step 0\n" + ONE_NODE.read_text() + "NCCL INFO Bootstrap\n" + text
    tests = parse_nccl_tests(text.splitlines())
    assert [t.collective for t in tests] == ["all_reduce", "reduce_scatter"]
    assert [len(t.rows) for t in tests] == [31, 31]


def test_per_iteration_and_error_column_layouts():
    lines = [
        "# nThread 1 nGpus 1 minBytes 1024 maxBytes 2048 step: 2(factor) warmup iters: 1",
        "#  Rank  0 Group  0 Pid   1234 on     node-1 device  0 [0000:18:00] NVIDIA H100",
        "#  Rank  1 Group  0 Pid   1235 on     node-1 device  1 [0000:2a:00] NVIDIA H100",
        "#       size         count      type   redop    root     time   algbw   busbw  #wrong"
        "    i_min    i_max    i_p99    i_cv%     time   algbw   busbw  #wrong    i_min    i_max"
        "    i_p99    i_cv%",
        "        1024           256     float     sum      -1    20.10    0.05    0.05       0"
        "    19.00    25.00    24.00     3.10    19.90    0.05    0.05       0    19.10    24.00"
        "    23.00     2.90",
    ]
    (t,) = parse_nccl_tests(lines, "all_reduce_perf.log")
    assert t.rows[0].out_of_place == (20.10, 0.05, 0.05, 0)
    assert t.rows[0].in_place == (19.90, 0.05, 0.05, 0)
    old = [
        "# nThread 1 nGpus 2 minBytes 8 maxBytes 16 step: 2(factor) warmup iters: 5 iters: 20",
        "#  Rank  0 Pid  40960 on     gpu-01 device  0 [0x06] Tesla V100-SXM2-32GB",
        "#       size         count      type   redop     time   algbw   busbw  error"
        "     time   algbw   busbw  error",
        "           8             2     float     sum    12.50    0.00    0.00  0e+00"
        "    12.30    0.00    0.00  2e-07",
    ]
    (t,) = parse_nccl_tests(old, "all_reduce_perf.out")
    assert t.ranks == [(0, "gpu-01", "Tesla V100-SXM2-32GB")]  # no "Group" in 2019 builds
    assert t.rows[0].root == -1 and t.rows[0].out_of_place[0] == 12.5
    assert t.rows[0].in_place[3] is None  # an error magnitude, not a count


def test_bad_logs_are_spec_errors(tmp_path):
    with pytest.raises(SpecError, match="cannot be read"):
        read_nccl_tests_log(tmp_path / "missing.txt")
    empty = tmp_path / "all_reduce_perf.txt"
    empty.write_text("# nThread 1 nGpus 8 minBytes 8 maxBytes 8\n# Avg bus bandwidth : 0\n")
    with pytest.raises(SpecError, match="no nccl-tests data rows"):
        read_nccl_tests_log(empty)
    unnamed = tmp_path / "run.log"
    unnamed.write_text(TWO_NODES_AR.read_text())
    with pytest.raises(SpecError, match="--collective"):
        read_nccl_tests_log(unnamed)
    assert read_nccl_tests_log(unnamed, "all_reduce")[0].num_ranks == 16


def test_nccl_tests_json_output_matches_text():
    (j,) = read_nccl_tests_log(DATA / "all_reduce_perf_8xH100_1node.json")
    (t,) = read_nccl_tests_log(ONE_NODE)
    assert j.collective == "all_reduce"  # from args[0], ./build/all_reduce_perf
    assert j.ranks == t.ranks and len(j.rows) == len(t.rows)
    for a, b in zip(j.rows, t.rows, strict=True):
        assert (a.size_bytes, a.count, a.dtype, a.redop, a.root) == (
            b.size_bytes,
            b.count,
            b.dtype,
            b.redop,
            b.root,
        )
        for x, y in ((a.out_of_place, b.out_of_place), (a.in_place, b.in_place)):
            assert x[0] == pytest.approx(y[0], abs=0.06)  # text keeps 7 characters
            assert x[2] == pytest.approx(y[2], abs=0.006)
            assert x[3] == y[3] == 0
    assert j.avg_busbw_GBps == pytest.approx(t.avg_busbw_GBps, abs=1e-3)
    assert j.mean_busbw() == pytest.approx(j.avg_busbw_GBps, abs=1e-5)
