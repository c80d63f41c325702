"""CheckpointManager: sharded, async, checksummed, atomically committed checkpoints over DCP.

Layout under ``root``::

    step_00000020.partial/   being written (ignored by load, removed at the next start)
    step_00000010/           committed: DCP files + MANIFEST.json (per-file SHA-256 and size)
    LATEST                   "step_00000010", replaced by rename after each commit

Why not plain ``dcp.save(..., overwrite=True)`` into one folder: a crash while re-saving there
leaves an old ``.metadata`` next to truncated new shards, and DCP has no checksums
(fault-tolerance notes, section 5). Every save therefore goes into a fresh folder; the manifest
is written last and the folder renamed into place, so a checkpoint is either committed whole or
not at all.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from aihpc.resilience.manifest import (
    FORMAT,
    MANIFEST,
    POINTER,
    CheckpointCorruptError,
    CheckpointInfo,
    CheckpointMismatchError,
    check_identity,
    committed_checkpoints,
    fsync_dir,
    point_latest,
    quarantine,
    scan_checkpoints,
    settle,
    sha256_file,
    verify_checkpoint,
    write_atomic,
)

__all__ = [
    "MANIFEST",
    "CheckpointCorruptError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointMismatchError",
    "ModelOptimizerState",
    "RNGState",
    "state_sha256",
    "verify_checkpoint",
]

log = logging.getLogger("aihpc.resilience")


class ModelOptimizerState:
    """Stateful for a model and its optimizer(s), keyed by parameter names (FQNs), not ids.

    FQN keys plus DTensor shards are what let a checkpoint saved on N ranks load on M ranks;
    ``optimizer.state_dict()`` keys by parameter index and would not reshard. The optimizer
    state is flattened (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``), so a rank that
    holds some layers (a pipeline stage) saves and loads exactly those, under any plan.
    """

    _OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model: nn.Module, optimizers: torch.optim.Optimizer | Iterable[Any]):
        self.model = model
        self.optimizers = optimizers

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizers, options=self._OPTIONS)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizers,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
            options=StateDictOptions(strict=True, flatten_optimizer_state_dict=True),
        )


class RNGState:
    """Stateful for torch's global generators (CPU and, when present, the current CUDA device).

    Saved once per checkpoint: it assumes every rank holds the same RNG state, which is true when
    all ranks seed alike and draw alike (the aihpc trainer draws nothing per rank). A loop with
    per-rank streams (e.g. dropout seeded by rank) should save its own rank-keyed Stateful.
    """

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            sd["cuda"] = torch.cuda.get_rng_state()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["cpu"])
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda"])


def _state_dicts(state: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, obj in state.items():
        if isinstance(obj, nn.Module):
            raise TypeError(
                f"state[{key!r}] is a bare nn.Module; wrap it with its optimizer in "
                "ModelOptimizerState(model, optimizer) so it reshards"
            )
        if isinstance(obj, torch.optim.Optimizer):
            raise TypeError(
                f"state[{key!r}] is a bare Optimizer (keyed by parameter index, does "
                "not reshard); use ModelOptimizerState(model, optimizer)"
            )
        out[key] = obj.state_dict() if hasattr(obj, "state_dict") else obj
    return out


def _stage(obj: Any) -> Any:
    """Deep copy onto the CPU so training may mutate its tensors while the copy is written.

    DCP's own CPU staging once aliased CPU tensors instead of copying them (pytorch#144657), and
    NVRx / Megatron tore async checkpoints the same way; copying here makes isolation ours to test.
    """
    if isinstance(obj, DTensor):
        local = obj.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(
            local,
            obj.device_mesh,
            obj.placements,
            run_check=False,
            shape=obj.size(),
            stride=obj.stride(),
        )
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _stage(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_stage(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_stage(v) for v in obj)
    return copy.deepcopy(obj)


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, DTensor):
        obj = obj.to_local()
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _walk(obj: Any, prefix: str) -> Iterable[tuple[str, Any]]:
    if isinstance(obj, Mapping):
        for k in sorted(obj, key=str):
            yield from _walk(obj[k], f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{prefix}[{i}]")
    else:
        yield prefix, obj


def _entry_digest(value: Any) -> str:
    h = hashlib.sha256()
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        h.update(f"{type(value).__name__}:{value!r}".encode())
    return h.hexdigest()


def state_sha256(state: Mapping[str, Any]) -> str:
    """SHA-256 over the full (unsharded) state: the same bits give the same hash under any plan
    and world size.

    Each entry is hashed whole (DTensors gathered with ``full_tensor()`` among the ranks that
    share them, keys in sorted order so those collectives line up); under torch.distributed
    the per-entry digests of every rank are then merged, so a pipeline stage that holds some
    layers contributes exactly those. Collective: every rank must call it at the same point.
    """
    digests = {name: _entry_digest(v) for name, v in _walk(_state_dicts(state), "")}
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, digests)
        for other in gathered:
            digests.update(other)
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(name.encode() + b"\0" + digests[name].encode())
    return h.hexdigest()


class CheckpointManager:
    """Save and restore any Stateful objects (``state_dict`` / ``load_state_dict``) through DCP.

    ``state`` maps names to Stateful objects, e.g. ``{"train": ModelOptimizerState(model, opt),
    "sched": lr_scheduler, "data": loader, "rng": RNGState()}``. Works with 1 process and no
    process group, or under torch.distributed (every rank calls every method).

    ``async_save``: ``save`` copies the state to CPU memory and returns; a background thread writes
    it with ``dcp.save`` over a dedicated gloo group (a background save on the training group
    breaks the job, see the CPU notes section 4) and then commits.
    ``before_commit(step)`` runs on every rank after its files are written and before the commit;
    fault injection uses it to kill a writer mid-checkpoint.
    ``identity``: the fields of the run that must match for a checkpoint to be resumed (model,
    data, seed...); recorded in every manifest, and ``load_latest`` refuses a checkpoint whose
    recorded identity differs (CheckpointMismatchError names the fields).
    """

    def __init__(
        self,
        root: str | Path,
        *,
        keep_last: int = 3,
        async_save: bool = True,
        process_group: Any = None,
        verify: bool = True,
        before_commit: Callable[[int], None] | None = None,
        identity: Mapping[str, Any] | None = None,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.async_save = async_save
        self.verify = verify
        self.before_commit = before_commit
        self.identity = dict(identity) if identity is not None else None
        self._distributed = dist.is_available() and dist.is_initialized()
        if not self._distributed:
            # One process without a process group is a supported mode, not a mistake.
            warnings.filterwarnings(
                "ignore", message="torch.distributed is disabled", category=UserWarning
            )
        self.rank = dist.get_rank() if self._distributed else 0
        self._pg = process_group
        self._own_pg = False
        if self._distributed and self._pg is None:
            # Collective (every rank creates it); gloo because staged tensors live on the CPU.
            self._pg = dist.new_group(backend="gloo")
            self._own_pg = True
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aihpc-ckpt")
        self._pending: Future[None] | None = None
        self._known_intact: int | None = None
        self._lock = threading.Lock()
        self.last_blocking_s = 0.0
        self.last_state_bytes = 0  # this rank's staged bytes at the last save
        self.problems: list[str] = []  # what the last load_latest found wrong, one line each
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            # Folders of saves that never committed (a crash mid-write) are garbage by design.
            for partial in self.root.glob("*.partial"):
                log.warning("removing uncommitted checkpoint %s", partial)
                shutil.rmtree(partial, ignore_errors=True)
        self._barrier()

    # ---- discovery -----------------------------------------------------------------------
    def committed(self) -> list[CheckpointInfo]:
        """Committed checkpoints (manifest present), oldest first. Not verified."""
        return committed_checkpoints(self.root)[0]

    def latest_intact(self) -> tuple[CheckpointInfo | None, list[str]]:
        """Newest committed checkpoint whose files match their manifest, and the problems seen:
        step folders without a manifest, a LATEST that names no committed checkpoint, and
        checkpoints that failed verification, each named in one line (nothing is moved)."""
        scan = scan_checkpoints(self.root, self.verify)
        for line in scan.lines():
            log.warning("%s", line)
        return scan.intact, scan.lines()

    # ---- save ----------------------------------------------------------------------------
    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Checkpoint ``state`` as of ``step``. Async: returns once the state is copied."""
        start = time.perf_counter()
        self.wait()  # one save in flight: bounds memory and keeps commits in step order
        staged = _stage(_state_dicts(state))
        self.last_state_bytes = _tensor_bytes(staged)
        if self.async_save:
            self._pending = self._pool.submit(self._write_and_commit, step, staged)
        else:
            self._write_and_commit(step, staged)
            self._barrier()
        self.last_blocking_s = time.perf_counter() - start

    def wait(self) -> None:
        """Block until the in-flight save is committed; re-raise its error, if any."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _write_and_commit(self, step: int, staged: dict[str, Any]) -> None:
        final = self.root / f"step_{step:08d}"
        partial = self.root / f"step_{step:08d}.partial"
        writer = dcp.FileSystemWriter(partial, sync_files=True)
        dcp.save(
            staged, storage_writer=writer, process_group=self._pg, no_dist=not self._distributed
        )
        # dcp.save returns on every rank only after the coordinator wrote .metadata, which it
        # does after gathering every rank's write result: all shards are on disk at this point.
        if self.before_commit is not None:
            self.before_commit(step)
        if self.rank == 0:
            self._commit(step, partial, final)

    def _commit(self, step: int, partial: Path, final: Path) -> None:
        files = {}
        for f in sorted(partial.iterdir()):
            if f.is_file():
                files[f.name] = {"sha256": sha256_file(f), "size": f.stat().st_size}
        world = dist.get_world_size(self._pg) if self._distributed else 1
        manifest = {
            "format": FORMAT,
            "step": step,
            "world_size": world,
            "created_unix": time.time(),
            "files": files,
        }
        if self.identity is not None:
            manifest["run"] = self.identity
        write_atomic(partial / MANIFEST, json.dumps(manifest, indent=1).encode())
        with self._lock:
            if final.exists():  # a folder the load did not resume (no manifest, or not read)
                kept = quarantine(final, self.root)
                log.warning("%s: replaced by a new save of step %d; kept as %s", final, step, kept)
            os.replace(partial, final)
            fsync_dir(self.root)
            moved = point_latest(self.root, final.name)
            if moved is not None:
                log.warning("%s was not a file; moved to %s", self.root / POINTER, moved)
            self._known_intact = step
            self._retain()
        log.info("checkpoint step %d committed (%d files)", step, len(files))

    def _retain(self) -> None:
        """Keep the newest ``keep_last`` committed checkpoints and the newest known-intact one."""
        infos = self.committed()
        keep = {c.step for c in infos[-self.keep_last :]}
        if self._known_intact is not None:
            keep.add(self._known_intact)
        for c in infos:
            if c.step not in keep:
                # Un-commit by rename first: a crash mid-delete leaves a *.partial (ignored and
                # cleaned up), never a committed folder with files missing.
                trash = c.path.with_name(c.path.name + ".deleting.partial")
                os.replace(c.path, trash)
                shutil.rmtree(trash, ignore_errors=True)

    # ---- load ----------------------------------------------------------------------------
    def load_latest(self, state: Mapping[str, Any]) -> int | None:
        """Load the newest intact checkpoint into ``state``; its step, or None if there is none.

        Rank 0 verifies checksums and picks the checkpoint; every rank then loads it (resharding
        to this world size). If checkpoints exist but none is intact, raise CheckpointCorruptError.
        """
        choice: list[Any] = [self._choose() if self.rank == 0 else None]
        if self._distributed:
            dist.broadcast_object_list(choice, src=0, group=self._pg)
        step, path, self.problems, error = choice[0]
        if error is not None:
            kind, message = error
            if kind == "mismatch":
                raise CheckpointMismatchError(Path(path), message)
            raise CheckpointCorruptError(message)
        if step is None:
            return None
        self._load_path(Path(path), state)
        self._known_intact = step
        return int(step)

    def _choose(self) -> tuple[int | None, str | None, list[str], tuple[str, Any] | None]:
        """Rank 0's pick: (step, path, problems, error) — plain data, to be broadcast. A corrupt
        checkpoint newer than the pick is moved aside and LATEST names the pick (``settle``)."""
        scan = scan_checkpoints(self.root, self.verify)
        info, problems = scan.intact, scan.lines()
        if info is None:
            for line in problems:
                log.error("%s", line)
            if not problems:
                return None, None, [], None  # a fresh run
            message = f"no intact checkpoint under {self.root}: " + "; ".join(problems)
            return None, None, problems, ("corrupt", message)
        try:
            check_identity(info.path, self.identity)  # the format, and the run when given
        except CheckpointMismatchError as err:
            return info.step, str(info.path), problems, ("mismatch", err.differences)
        problems = settle(self.root, scan)
        for line in problems:
            log.warning("%s", line)
        return info.step, str(info.path), problems, None

    def load(self, step: int, state: Mapping[str, Any]) -> None:
        """Load one given step (verified first)."""
        path = self.root / f"step_{step:08d}"
        if self.rank == 0 and self.verify:
            verify_checkpoint(path)
        self._load_path(path, state)

    def _load_path(self, path: Path, state: Mapping[str, Any]) -> None:
        sds = _state_dicts(state)
        dcp.load(sds, checkpoint_id=path, process_group=self._pg, no_dist=not self._distributed)
        for key, obj in state.items():
            if hasattr(obj, "load_state_dict"):
                obj.load_state_dict(sds[key])
        log.info("loaded checkpoint %s", path.name)

    # ---- teardown ------------------------------------------------------------------------
    def close(self) -> None:
        """Finish the in-flight save and release the thread and the checkpoint group."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            if self._own_pg and self._pg is not None and dist.is_initialized():
                dist.destroy_process_group(self._pg)
                self._pg = None

    def _barrier(self) -> None:
        if self._distributed:
            dist.barrier(group=self._pg)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
