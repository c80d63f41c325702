"""The one owner of distributed side effects: process group, device, teardown. (The device
mesh of a plan belongs to ``aihpc.runtime.mesh.Parallel``, built from the plan once the process
group is up.)

``init_distributed()`` works the same under torchrun (RANK / WORLD_SIZE / MASTER_* set), under
srun (SLURM_* set) and as a plain single process (a private world of one), so the trainer has
one code path for 1 and N ranks.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from aihpc._net import free_port

__all__ = ["DistContext", "free_port", "init_distributed", "launcher_env", "rendezvous_store"]


@dataclass(frozen=True)
class DistContext:
    """The rank facts; passed explicitly (no module-level globals)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    # A second gloo group for checkpoint collectives: a background save must not share the
    # training group (gloo "collective mismatch" aborts, CPU notes section 4).
    checkpoint_group: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launcher_env(env: dict[str, str] | None = None) -> dict[str, str] | None:
    """RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* as torch expects them, or None when no launcher.

    torchrun sets them itself; under srun they are derived from SLURM_* (MASTER_ADDR must be
    set by the batch script, or falls back to the launch node; the port derives from the job id).
    """
    env = dict(os.environ if env is None else env)
    if "RANK" in env and "WORLD_SIZE" in env:
        return {
            k: env[k]
            for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
            if k in env
        }
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        job = int(env.get("SLURM_JOB_ID", "0") or 0)
        return {
            "RANK": env["SLURM_PROCID"],
            "WORLD_SIZE": env["SLURM_NTASKS"],
            "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
            "MASTER_ADDR": env.get("MASTER_ADDR", env.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")),
            "MASTER_PORT": env.get("MASTER_PORT", str(20000 + job % 20000)),
        }
    return None


_LAUNCHER_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _restore_env(before: dict[str, str | None]) -> None:
    """Put the rank variables back as they were: a private world of one made in-process must
    not look like a launcher to whatever the same process runs next (a bench, a second run)."""
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _rank_env() -> dict[str, str]:
    """The launcher's rank variables (a private world of one without a launcher), exported."""
    found = launcher_env()
    if found is None:
        found = {
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
        }
    os.environ.update(found)
    return found


def rendezvous_store(timeout_s: float = 600.0) -> Any:
    """The job's key-value store, as ``init_process_group`` would find it (torchrun's, or one
    rank 0 hosts). An in-process restart keeps it and forms each new generation of process
    groups under a prefix of its own."""
    found = _rank_env()
    rank, world = int(found["RANK"]), int(found["WORLD_SIZE"])
    store, _, _ = next(
        dist.rendezvous("env://", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    )
    return store


@contextmanager
def init_distributed(
    timeout_s: float = 600.0, store: Any = None, generation: int = 0
) -> Iterator[DistContext]:
    """Init the process group (nccl on GPU, gloo on CPU) and a gloo group for checkpoints.

    ``timeout_s`` bounds every collective: without it gloo waits 30 minutes on a dead peer.
    ``store`` (from ``rendezvous_store``): form the groups over it under the prefix of
    ``generation`` (an in-process restart's new groups never meet the old ones' keys).
    The group is destroyed on the way out, also after an exception.
    """
    before = {k: os.environ.get(k) for k in _LAUNCHER_KEYS}
    found = _rank_env()
    rank, world = int(found["RANK"]), int(found["WORLD_SIZE"])
    local_rank = int(found.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        # Exact resume needs run-to-run determinism: cuBLAS needs a fixed workspace and some
        # CUDA kernels (atomics) need the deterministic variants. Untested on GPU so far.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        backend = "cpu:gloo,cuda:nccl"  # gloo too, for CPU-staged checkpoint collectives
    else:
        device = torch.device("cpu")
        backend = "gloo"
    prefixed = None if store is None else dist.PrefixStore(f"aihpc/gen{generation}/", store)
    dist.init_process_group(
        backend=backend,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
        store=prefixed,
    )
    try:
        checkpoint_group = dist.new_group(backend="gloo")
        yield DistContext(
            rank=rank,
            world_size=world,
            local_rank=local_rank,
            device=device,
            backend=backend,
            checkpoint_group=checkpoint_group,
        )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        _restore_env(before)
