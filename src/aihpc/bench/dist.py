"""The process group for the benchmarks: one object owns it, one function owns the side effects.

``init_distributed()`` is the only place that touches torch.distributed's global state: it picks
the backend from the device (NCCL on GPU, gloo on CPU), sets the timeout, and destroys the group in
``finally``. It joins whatever launched it: torchrun (``RANK`` / ``WORLD_SIZE`` /
``MASTER_ADDR``), srun without torchrun (``SLURM_PROCID`` / ``SLURM_NTASKS``; the rendezvous host is
the first node of the step), or ``launch_local`` (``--nproc-per-node N``), which spawns N local
workers on a free port.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from aihpc._net import free_port

__all__ = [
    "DistContext",
    "free_port",
    "init_distributed",
    "launch_local",
    "launcher_env",
    "run_facts",
]


@dataclass
class DistContext:
    """Who this process is in the job, and its device. Passed explicitly to everything."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    hostnames: list[str] = field(default_factory=list)  # per rank, gathered at start

    def sync(self) -> None:
        """Wait for queued device work (collectives on GPU return once enqueued)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def num_nodes(self) -> int:
        return len(set(self.hostnames)) or 1


def _first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list (``gpu[017-020,031],login1`` -> ``gpu017``), no scontrol."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        return nodelist
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def launcher_env(env: dict[str, str] | None = None) -> dict[str, str] | None:
    """The rendezvous variables of the launcher that started us, or None when run directly."""
    env = dict(os.environ if env is None else env)
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun, or launch_local
        env.setdefault("LOCAL_RANK", "0")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", "29500")
        return env
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:  # srun, one task per GPU
        out = dict(env)
        out["RANK"] = env["SLURM_PROCID"]
        out["WORLD_SIZE"] = env["SLURM_NTASKS"]
        out["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        out.setdefault("MASTER_ADDR", _first_slurm_host(nodes))
        # same rule as enroot's Slurm hook, so jobs sharing a node do not collide
        out.setdefault("MASTER_PORT", str(int(env.get("SLURM_JOB_ID", "0")) % 4536 + 61000))
        return out
    return None


@contextlib.contextmanager
def init_distributed(timeout_s: float = 300.0, backend: str | None = None) -> Iterator[DistContext]:
    """Create the process group for this process, yield its context, always tear it down.

    A process started by no launcher becomes a world of one (useful for GEMM and smoke runs).
    """
    env = launcher_env() or {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    rank, world, local_rank = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = device  # eager NCCL init: a bad fabric fails here, not mid-sweep
    dist.init_process_group(
        backend,
        init_method=f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )
    try:
        hosts: list[Any] = [None] * world
        dist.all_gather_object(hosts, socket.gethostname())
        yield DistContext(rank, world, local_rank, backend, device, [str(h) for h in hosts])
    finally:
        dist.destroy_process_group()


def _spawned(
    local_rank: int, nproc: int, port: int, fn: Callable[..., Any], args: tuple, result_path: str
) -> None:
    os.environ.update(
        {
            "RANK": str(local_rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        # as torchrun does: N workers on few cores must not each start a full OpenMP pool
        torch.set_num_threads(1)
    result = fn(*args)
    if local_rank == 0:
        torch.save(result, result_path)


def launch_local(nproc: int, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` in ``nproc`` fresh local processes joined in one group; return rank 0's
    result. ``fn`` must be importable (module level) because workers are spawned, not forked:
    a forked child would inherit the parent's threads and torch state."""
    with tempfile.TemporaryDirectory(prefix="aihpc-launch-") as tmp:
        result_path = str(Path(tmp) / "rank0.pt")
        torch.multiprocessing.start_processes(
            _spawned,
            args=(nproc, free_port(), fn, args, result_path),
            nprocs=nproc,
            join=True,
            start_method="spawn",
        )
        return torch.load(result_path, weights_only=False) if Path(result_path).exists() else None


def run_facts(ctx: DistContext) -> dict[str, Any]:
    """What a benchmark's JSON records about the run besides its numbers."""
    return {
        "backend": ctx.backend,
        "world_size": ctx.world_size,
        "num_nodes": ctx.num_nodes,
        "torch_version": torch.__version__,
        "nccl_version": (
            ".".join(map(str, torch.cuda.nccl.version())) if ctx.backend == "nccl" else None
        ),
        # what decides NCCL's algorithm and protocol travels with the numbers
        "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
    }
