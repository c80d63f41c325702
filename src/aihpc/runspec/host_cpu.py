"""The host CPU a GPU part is sold with, as a ratio of host time (``data/host_cpus.toml``).

The per-op host costs the planner prices (an eager op's issue, a kernel launch from C++, a serving
engine's host step) were measured on x86 hosts. A Grace host (GB200, GB300) takes longer for the
same call: NVIDIA/TransformerEngine issue #2053 timed one Transformer Engine linear forward at
37.08 us of CPU time on a GB200 against 13.48 us on a DGX H100's Xeon. ``host_cpu_ratio`` is a
GPU's row's time over the reference row's; a GPU in no row (or a custom one) gets 1.
"""

from __future__ import annotations

import tomllib
from functools import cache
from importlib import resources
from typing import Any

__all__ = ["host_cpu_ratio", "host_cpu_rows"]


@cache
def host_cpu_rows() -> tuple[dict[str, Any], ...]:
    """The ``[[host_cpu]]`` rows, each with its host, GPUs, per-call time and source."""
    text = resources.files("aihpc.runspec").joinpath("data/host_cpus.toml").read_text()
    return tuple(tomllib.loads(text)["host_cpu"])


@cache
def _ratios() -> dict[str, float]:
    rows = host_cpu_rows()
    refs = [row for row in rows if row.get("reference")]
    if len(refs) != 1:
        raise ValueError(f"host_cpus.toml: {len(refs)} [[host_cpu]] reference rows, need 1")
    ref = float(refs[0]["torch_op_cpu_us"])
    return {gpu: float(row["torch_op_cpu_us"]) / ref for row in rows for gpu in row["gpus"]}


def host_cpu_ratio(gpu_id: str) -> float:
    """Host time of one eager call on ``gpu_id``'s host over the x86 reference host's (1 where
    the catalog names no host for the part)."""
    return _ratios().get(gpu_id, 1.0)
