"""Shared by the benchmarks: machine facts, timing on a device, results with their command."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

# Where a run writes NAME.json and NAME.md unless --results names a folder: the current folder's
# benchmark-results/, never the project's committed figures (benchmarks/results/, which a run
# replaces only when asked to with --results benchmarks/results).
DEFAULT_RESULTS = Path("benchmark-results")
RESULTS_HELP = (
    "folder for the NAME.json and NAME.md results (default: ./benchmark-results; the project's "
    "published figures are in benchmarks/results)"
)


def add_results_arg(ap: argparse.ArgumentParser) -> None:
    """``--results DIR``: every benchmark script writes where its user says."""
    ap.add_argument(
        "--results", type=Path, default=DEFAULT_RESULTS, metavar="DIR", help=RESULTS_HELP
    )


def machine() -> dict:
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        # the vector unit PyTorch's CPU kernels dispatch to: their rounding, so a CPU run's digits
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpus": os.cpu_count(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def median_ms(fn, device, iters: int = 3, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in ms after ``warmup`` calls, synchronising a CUDA device."""
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def save(name: str, data: dict, markdown: str, results: Path = DEFAULT_RESULTS) -> None:
    """RESULTS/NAME.json and NAME.md, both naming the command that produced them."""
    results.mkdir(parents=True, exist_ok=True)
    command = "python " + " ".join([f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    data = {"command": command, **data}
    (results / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    (results / f"{name}.md").write_text(
        f"Produced by `{command}` on {data['machine']['date_utc']} "
        f"({data['machine']}).\n\n{markdown}\n"
    )
    print(markdown)


def catalog_gpu() -> str:
    """The catalog id of the machine's GPU (H100 / H200 / A100 / B200 by name)."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU visible")
    name = torch.cuda.get_device_name().lower()
    for key, gpu in (("h200", "h200"), ("h100", "h100-sxm"), ("h800", "h800"), ("b200", "b200")):
        if key in name:
            return gpu
    if "a100" in name:
        return (
            "a100-80gb"
            if torch.cuda.get_device_properties(0).total_memory > 50e9
            else ("a100-40gb")
        )
    raise SystemExit(f"{name!r} is not in the GPU catalog (aihpc gpus)")
