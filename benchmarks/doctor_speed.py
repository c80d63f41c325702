"""How fast `aihpc doctor` reads logs: a synthetic job log of N MiB (a 1,024-rank job's
training chatter and NCCL INFO lines, with one Xid and its follow-on timeouts buried in it) read
and diagnosed end to end, one core.

    python benchmarks/doctor_speed.py --results benchmarks/results   # 256 MiB
    python benchmarks/doctor_speed.py --mib 64                       # ./benchmark-results/

The lines are the corpus's formats (tests/observe/corpus); the mix (mostly plain step lines,
a tenth NCCL INFO lines, few matches) is what a healthy multi-day job's output looks like, so
the figure is the filter's speed, which decides how long gigabytes take.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import add_results_arg, save

from aihpc.observe.doctor import diagnose

STEP = "[2026-11-30 04:{m:02d}:{s:02d},{ms:03d}][INFO][train.py:402] - step {i} | loss 1.9021 | grad norm 0.42 | 4.12 s/step | 1,984 tok/s/GPU\n"  # noqa: E501
NCCL = "gpu-b{n:02d}:{pid}:{tid} [{d}] NCCL INFO Channel {c:02d}/0 : {r}[{d}] -> {p}[{d}] [send] via NET/IB/{d}/GDRDMA\n"  # noqa: E501
XID = "[Mon Nov 30 10:14:05 2026] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"  # noqa: E501
TIMEOUT = "[rank{r}]:[E1130 10:24:07.511027733 ProcessGroupNCCL.cpp:632] [Rank {r}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=20411, OpType=ALLREDUCE, NumelIn=262144000, NumelOut=262144000, Timeout(ms)=600000) ran for 600044 milliseconds before timing out.\n"  # noqa: E501


def write_log(path: Path, mib: int) -> int:
    """A job log of about ``mib`` MiB ending in the failure's lines. Returns its line count."""
    target, lines, i = mib << 20, 0, 0
    with open(path, "w") as f:
        size = 0
        while size < target:
            i += 1
            line = (
                NCCL.format(
                    n=i % 64,
                    pid=4000 + i % 8,
                    tid=5000 + i % 97,
                    d=i % 8,
                    c=i % 32,
                    r=i % 1024,
                    p=(i + 8) % 1024,
                )
                if i % 10 == 0
                else STEP.format(m=(i // 60) % 60, s=i % 60, ms=i % 1000, i=i)
            )
            f.write(line)
            size += len(line)
            lines += 1
        f.write(XID)
        for r in range(0, 1024, 7):
            f.write(TIMEOUT.format(r=r))
            lines += 1
    return lines + 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    add_results_arg(ap)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "job.log"
        lines = write_log(log, args.mib)
        size = log.stat().st_size
        t0 = time.perf_counter()
        d = diagnose([log])
        seconds = time.perf_counter() - t0
    assert d.cls == "xid", d.summary  # the buried cause is found
    mb_s = size / 2**20 / seconds
    data = {
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_avg": [round(x, 2) for x in os.getloadavg()],
            "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        },
        "log_mib": round(size / 2**20, 1),
        "lines": lines,
        "seconds": round(seconds, 2),
        "mib_per_s": round(mb_s, 1),
        "lines_per_s": round(lines / seconds),
        "found": d.summary,
    }
    table = (
        "| log | lines | seconds | MiB/s | lines/s | found |\n|---|---|---|---|---|---|\n"
        f"| {data['log_mib']} MiB | {lines:,} | {seconds:.1f} | {mb_s:.1f} | "
        f"{lines / seconds:,.0f} | {d.summary} |"
    )
    save("doctor_speed", data, table, args.results)


if __name__ == "__main__":
    main()
