"""Write the nccl-tests-format samples in this folder (run: python make_nccl_samples.py).

The text layout is nccl-tests' own printf formats (src/util.cu at v2.19.6, src/common.cu at
v2.13.8), re-typed here independently of aihpc's formatter so the parser is not tested against
itself. The numbers are not a capture from a real machine: they are modelled on published
measurements and marked as such in each file's README line below.

* 8x H100 SXM, one DGX node, all_reduce (new v2.19 layout, and the same run as the JSON file
  that nccl-tests' -J option writes): times log-interpolated between the
  all_reduce points of Azure's ND H100 v5 table (1 MB 44, 16 MB 234, 256 MB 423, 1 GB 466,
  8 GB 478.9 GB/s busbw; 1 KiB 0.07 GB/s) (Azure/AI-benchmarking-guide, ND_H100_v5_results.md).
* 2 nodes x 8 H100, 8x 400G NDR InfiniBand (old v2.13 layout, 16 ranks, one file per binary, as
  a user who redirects each run writes them): all_reduce tending to ~362 GB/s busbw at 8 GiB
  (46-48 GB/s per NDR NIC x 8, nccl-tests issue #290), and all_gather with checking off
  (-c 0, "N/A").
"""

# ruff: noqa: UP031  (printf-style on purpose: these are nccl-tests' C formats, verbatim)

from __future__ import annotations

import math
import random
from pathlib import Path

HERE = Path(__file__).parent
DGX_H100_BUS = [0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB]
GPU = "NVIDIA H100 80GB HBM3"
FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n}


def interp_time(size: float, anchors: list[tuple[float, float]]) -> float:
    xs = [math.log(a) for a, _ in anchors]
    ys = [math.log(b) for _, b in anchors]
    x = math.log(size)
    for i in range(1, len(xs)):
        if x <= xs[i]:
            w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return math.exp(ys[i - 1] + w * (ys[i] - ys[i - 1]))
    return math.exp(ys[-1])


def float_str(value: float, width: int) -> str:  # util.cu getFloatStr
    for fmt in ("%*.2f", "%*.1f", "%*.0f"):
        s = fmt % (width, value)
        if len(s) <= width:
            return s
    return ("%*.1e" if width >= 7 else "%*.0e") % (width, value)


def old_time_str(t: float) -> str:  # common.cu v2.13
    return "%7.0f" % t if t >= 10000 else ("%7.1f" % t if t >= 100 else "%7.2f" % t)


def rows(coll: str, n: int, anchors, rng, new: bool, check: bool, js=None):
    out, bws = [], []
    size = 8
    while size <= 8 << 30:
        elem = 4
        count = size // elem
        if coll == "all_gather":
            chunk = (count // n) & ~(16 // elem - 1)
            if chunk == 0:
                size *= 2
                continue
            shown, count_col = chunk * n * elem, chunk
        else:
            shown, count_col = count * elem, count
        redop = "sum" if coll == "all_reduce" else "none"
        line = "%12li  %12li  %8s  %6s  %6s" % (shown, count_col, "float", redop, "%6i" % -1)
        entry = {
            "size": shown,
            "count": count_col,
            "type": "float",
            "redop": redop,
            "root": "%6i" % -1,
        }
        for half in ("out_of_place", "in_place"):
            t = interp_time(shown, anchors) * (1 + rng.uniform(-0.012, 0.012))
            alg = shown / 1e9 / (t * 1e-6)
            bus = alg * FACTOR[coll](n)
            bws.append(bus)
            # jsonDouble prints "%lf": six decimals
            entry[half] = {
                "time": round(t, 6),
                "alg_bw": round(alg, 6),
                "bus_bw": round(bus, 6),
                "nwrong": 0.0 if check else None,
            }
            if new:
                line += "  %7s  %6s  %6s" % (float_str(t, 7), float_str(alg, 6), float_str(bus, 6))
                line += "  %6g" % 0 if check else "    N/A"
            else:
                line += (
                    "  %7s  %6.2f  %6.2f  %5g" % (old_time_str(t), alg, bus, 0)
                    if check
                    else "  %7s  %6.2f  %6.2f  %5s" % (old_time_str(t), alg, bus, "N/A")
                )
        out.append(line)
        if js is not None:
            js.append({**entry, "actual_iterations": 20, "experiment_name": ""})
        size *= 2
    return out, sum(bws) / len(bws)


def single_node_new() -> str:
    rng = random.Random(17)
    anchors = [
        (8, 24.0),
        (1024, 25.6),
        (65536, 28.0),
        (1 << 20, 41.7),
        (16 << 20, 125.5),
        (256 << 20, 1110.0),
        (1 << 30, 4032.0),
        (8 << 30, 31390.0),
    ]
    body, avg = rows("all_reduce", 8, anchors, rng, new=True, check=True)
    lines = [
        "# nccl-tests version 2.17.1 nccl-headers=22105 nccl-library=22105",
        "# Collective test starting: all_reduce_perf",
        "# nThread 1 nGpus 8 minBytes 8 maxBytes 8589934592 step: 2(factor) warmup iters: 5"
        " iters: 20 agg iters: 1 validation: 1 graph: 0 unalign: 0",
        "#",
        "# Using devices",
    ]
    for r, bus in enumerate(DGX_H100_BUS):
        lines.append(
            "#  Rank %2d Group %2d Pid %6d on %10s device %2d [%04x:%02x:%02x] %s"
            % (r, 0, 412873, "dgx-h100-017", r, 0, bus, 0, GPU)
        )
    lines += [
        "#",
        "# %10s  %12s  %8s  %6s  %6s           out-of-place                       "
        "in-place          " % ("", "", "", "", ""),
        "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s %*s"
        % (
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
            0,
            "",
        ),
        "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s %*s"
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
            0,
            "",
        ),
        *body,
        "# %-20s : %d %s" % ("Out of bounds values", 0, "OK"),
        "# %-20s : %g %s" % ("Avg bus bandwidth", avg, ""),
        "#",
        "# Collective test concluded: all_reduce_perf",
    ]
    return "\n".join(lines) + "\n"


def multi_node_old_part(coll: str, anchors, seed: int, check: bool) -> str:
    rng = random.Random(seed)
    body, avg = rows(coll, 16, anchors, rng, new=False, check=check)
    lines = [
        "# nThread 1 nGpus 1 minBytes 8 maxBytes 8589934592 step: 2(factor) warmup iters: 5"
        f" iters: 20 agg iters: 1 validation: {int(check)} graph: 0",
        "#",
        "# Using devices",
    ]
    for r in range(16):
        host = "gpu-node-%03d" % (101 + r // 8)
        lines.append(
            "#  Rank %2d Group %2d Pid %6d on %10s device %2d [0x%02x] %s"
            % (r, 0, 233410 + 7 * r, host, r % 8, DGX_H100_BUS[r % 8], GPU)
        )
    lines += [
        "#",
        "# %10s  %12s  %8s  %6s  %6s           out-of-place                       "
        "in-place          " % ("", "", "", "", ""),
        "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s %6s  %7s  %6s  %6s %6s"
        % (
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
        ),
        "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %5s  %7s  %6s  %6s  %5s"
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
        *body,
        "# Out of bounds values : %d %s" % (0, "OK"),
        "# Avg bus bandwidth    : %g %s" % (avg, ""),
        "#",
        "",
    ]
    return "\n".join(lines) + "\n"


def single_node_json() -> str:
    """The same run as single_node_new, as nccl-tests -J writes it (src/util.cu, version 3)."""
    import json

    rng = random.Random(17)
    anchors = [
        (8, 24.0),
        (1024, 25.6),
        (65536, 28.0),
        (1 << 20, 41.7),
        (16 << 20, 125.5),
        (256 << 20, 1110.0),
        (1 << 30, 4032.0),
        (8 << 30, 31390.0),
    ]
    results: list[dict] = []
    _, avg = rows("all_reduce", 8, anchors, rng, new=True, check=True, js=results)
    devices = [
        {
            "rank": r,
            "group": 0,
            "pid": 412873,
            "hostname": "dgx-h100-017",
            "device": r,
            "device_hex": "0000:%02x:00" % bus,
            "device_info": GPU,
        }
        for r, bus in enumerate(DGX_H100_BUS)
    ]
    doc = {
        "version": 3,
        "start_time": "2025-11-03 14:07:51",
        "args": [
            "./build/all_reduce_perf",
            "-b",
            "8",
            "-e",
            "8G",
            "-f",
            "2",
            "-g",
            "8",
            "-J",
            "all_reduce_perf_8xH100_1node.json",
        ],
        "env": ["NCCL_DEBUG=VERSION"],
        "nccl_version": 22105,
        "config": {
            "nthreads": 1,
            "ngpus": 8,
            "minimum_bytes": 8,
            "maximum_bytes": 8589934592,
            "step_factor": 2,
            "warmup_iters": 5,
            "iterations": 20,
            "aggregated_iterations": 1,
            "validation": 1,
            "graph": 0,
            "blocking_collectives": False,
            "per_iter_timing": False,
            "per_iter_skip": 0,
            "parallel_init": False,
            "devices": devices,
        },
        "results": results,
        "out_of_bounds": {"count": 0, "okay": True},
        "average_bus_bandwidth": {"bandwidth": round(avg, 6), "okay": True},
        "end_time": "2025-11-03 14:09:12",
    }
    return json.dumps(doc, indent=2) + "\n"


def main() -> None:
    (HERE / "all_reduce_perf_8xH100_1node.txt").write_text(single_node_new())
    (HERE / "all_reduce_perf_8xH100_1node.json").write_text(single_node_json())
    ar = [
        (8, 42.0),
        (65536, 55.0),
        (1 << 20, 95.0),
        (16 << 20, 310.0),
        (256 << 20, 1720.0),
        (1 << 30, 5900.0),
        (8 << 30, 44500.0),
    ]
    ag = [
        (128, 38.0),
        (65536, 47.0),
        (1 << 20, 80.0),
        (16 << 20, 205.0),
        (256 << 20, 900.0),
        (1 << 30, 3000.0),
        (8 << 30, 22300.0),
    ]
    (HERE / "all_reduce_perf_2x8xH100_ib.txt").write_text(
        multi_node_old_part("all_reduce", ar, 5, True)
        + "gpu-node-101:233410:233410 [0] NCCL INFO comm 0x55d0c2a1e0 rank 0 nranks 16 cudaDev 0"
        " busId 18000 - Destroy COMPLETE\n"
    )
    (HERE / "all_gather_perf_2x8xH100_ib.txt").write_text(
        multi_node_old_part("all_gather", ag, 6, False)
    )


if __name__ == "__main__":
    main()
