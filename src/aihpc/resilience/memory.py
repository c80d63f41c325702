"""In-memory peer checkpoints: every N steps each rank's state in host memory, and a replica of
it on a rank of another node; a restart restores from them when they are there and agree.

Where the memory lives. A worker's own memory dies with it, so the copies are files in the
node's shared memory (``/dev/shm``, tmpfs: RAM, no disk): they outlive a worker that is killed
and the elastic agent's restart of the whole group, and are gone with the node. This is the
design of Gemini (SOSP'23: checkpoints in CPU memory, replicas on other machines) with the
node's kernel as the process that outlives the workers, instead of a resident agent process;
an in-process restart reads the same files. Each rank writes::

    <shm>/aihpc-<key>/own-<rank>.bin        its own state at the last snapshot
    <shm>/aihpc-<key>/held-<src>.bin        the replica it keeps for rank src (another node)

``key`` is derived from the run directory and a nonce kept in it, so a new run in the same
folder never reads an old run's memory. The folder is private (aihpc.resilience.private_dir:
created 0700, owner checked, no link followed); one a neighbour made first, one others can
write, or a link, is never used: the tier is off, on every rank, with one warning line, and
checkpoints go to storage only. A file is a JSON header (step, SHA-256 and size of
the payload, the rank it belongs to, a digest of what must match: run identity, world size,
plan) followed by
the payload, ``torch.save`` of the rank's local shards (model, optimizer, LR schedule, data
cursor, RNG: exactly what the storage checkpoint holds).

Restore (collective): every rank reports the steps it holds, verified (header, identity,
checksum); the newest step that *every* rank can get, from its own file or from its holder, and
that is not older than the newest storage checkpoint, is loaded; a rank without its own copy
receives the replica from its holder over gloo. Otherwise the caller loads from storage.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import secrets
import shutil
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from aihpc.resilience.checkpoint import _state_dicts
from aihpc.resilience.placement import Placement, peer_placement
from aihpc.resilience.private_dir import private_dir

__all__ = ["MemoryCheckpoint", "memory_key", "shm_root"]

log = logging.getLogger("aihpc.resilience")

_MAGIC = b"AIHPCMEM1\n"
_NONCE = "memory_ckpt.nonce"


def shm_root() -> Path:
    """The node's shared-memory folder (AIHPC_SHM_DIR overrides, e.g. where /dev/shm is small)."""
    return Path(os.environ.get("AIHPC_SHM_DIR", "/dev/shm"))


def memory_key(run_dir: Path) -> str:
    """A key for this run's memory files: the run directory and a nonce written in it once
    (rank 0 creates it before the tier starts)."""
    nonce_file = Path(run_dir) / _NONCE
    if not nonce_file.exists():
        tmp = nonce_file.with_suffix(".tmp")
        tmp.write_text(secrets.token_hex(8))
        os.replace(tmp, nonce_file)
    text = f"{Path(run_dir).resolve()}:{nonce_file.read_text().strip()}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _locals(obj: Any) -> Any:
    """The rank's own shards: DTensors as their local tensors, everything on the CPU."""
    if isinstance(obj, DTensor):
        obj = obj.to_local()
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _locals(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_locals(v) for v in obj)
    return obj


def _fill(current: Any, saved: Any, where: str = "") -> Any:
    """``current`` (a fresh state dict) with ``saved``'s values copied into its tensors in place
    (as DCP loads), keys checked."""
    if isinstance(current, DTensor):
        current.to_local().copy_(saved)
        return current
    if isinstance(current, torch.Tensor):
        if current.shape != saved.shape:
            raise ValueError(
                f"memory checkpoint {where}: shape {tuple(saved.shape)} != {tuple(current.shape)}"
            )
        current.copy_(saved)
        return current
    if isinstance(current, dict):
        if set(current) != set(saved):
            raise ValueError(f"memory checkpoint {where}: keys differ")
        return {k: _fill(current[k], saved[k], f"{where}.{k}") for k in current}
    if isinstance(current, list | tuple) and len(current) == len(saved):
        return type(current)(
            _fill(c, s, f"{where}[{i}]")
            for i, (c, s) in enumerate(zip(current, saved, strict=False))
        )
    return saved


def _encode(header: dict[str, Any], payload: memoryview | bytes) -> bytes:
    head = json.dumps(header).encode()
    return _MAGIC + len(head).to_bytes(4, "little") + head + bytes(payload)


def _decode(blob: bytes, digest: str) -> tuple[dict[str, Any], memoryview] | None:
    """(header, payload) when ``blob`` is whole, of this run and its checksum matches."""
    if not blob.startswith(_MAGIC):
        return None
    n = int.from_bytes(blob[len(_MAGIC) : len(_MAGIC) + 4], "little")
    start = len(_MAGIC) + 4
    try:
        header = json.loads(blob[start : start + n])
    except ValueError:
        return None
    payload = memoryview(blob)[start + n :]
    if header.get("identity") != digest or header.get("size") != len(payload):
        return None
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        return None
    return header, payload


class MemoryCheckpoint:
    """The in-memory tier of one rank. Collective: construct, ``snapshot`` and ``restore`` on
    every rank at the same point. ``max_bytes`` bounds this rank's own copy plus the replicas it
    keeps; a state over it is not snapshotted (``skipped`` says why)."""

    def __init__(
        self,
        run_dir: Path,
        identity: Mapping[str, Any],
        *,
        max_bytes: float,
        root: Path | None = None,
    ) -> None:
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.max_bytes = max_bytes
        if self.rank == 0:
            memory_key(run_dir)  # creates the nonce once
        dist.barrier()
        self.dir = (root or shm_root()) / f"aihpc-{memory_key(run_dir)}"
        unsafe = private_dir(self.dir)
        ident = {**identity, "world_size": self.world}
        self._digest = hashlib.sha256(
            json.dumps(ident, sort_keys=True, default=str).encode()
        ).hexdigest()
        # gloo: payloads are CPU bytes, and the storage tier's background saves own their group
        self._pg = dist.new_group(backend="gloo")
        hosts: list[Any] = [None] * self.world
        dist.all_gather_object(hosts, socket.gethostname(), group=self._pg)
        self.placement: Placement = peer_placement(hosts)
        self.holder = self.placement.holder[self.rank] if self.world > 1 else None
        self.held_for = self.placement.held_for(self.rank)
        self.last_step: int | None = None
        self.own_bytes = 0
        self.held_bytes = 0
        self.last_snapshot_s = 0.0
        self.skipped: str | None = None
        self.inventory: list[Any] = []
        self._own_blob: bytes | None = None
        self.off = self._agree_private(unsafe)

    def _agree_private(self, unsafe: str | None) -> str | None:
        """Every rank's folder private, or the tier off on all (collective); why it is off."""
        bad = torch.tensor([0 if unsafe is None else 1])
        dist.all_reduce(bad, group=self._pg)
        if not bad.item():
            return None
        if unsafe is not None:
            log.warning(
                "in-memory checkpoints off: %s %s; checkpoints go to storage only", self.dir, unsafe
            )
        why = f"{self.dir} {unsafe}" if unsafe else "another rank's memory folder is not private"
        self.skipped = f"in-memory tier off: {why}"
        return why

    # ---- files ---------------------------------------------------------------------------
    def _own(self) -> Path:
        return self.dir / f"own-{self.rank}.bin"

    def _held(self, src: int) -> Path:
        return self.dir / f"held-{src}.bin"

    def _write(self, path: Path, blob: bytes | memoryview) -> None:
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)

    def _read(self, path: Path) -> tuple[dict[str, Any], memoryview, bytes] | None:
        try:
            blob = path.read_bytes()
        except OSError:
            return None
        got = _decode(blob, self._digest)
        return (got[0], got[1], blob) if got else None

    # ---- snapshot ------------------------------------------------------------------------
    def snapshot(self, step: int, state: Mapping[str, Any]) -> bool:
        """Keep ``state`` as of ``step`` in memory here and at the holder; False if skipped."""
        if self.off:
            return False
        t0 = time.perf_counter()
        buf = io.BytesIO()
        torch.save(_locals(_state_dicts(state)), buf)
        payload = buf.getbuffer()
        header = {
            "step": step,
            "rank": self.rank,
            "size": len(payload),
            "sha256": hashlib.sha256(payload).hexdigest(),
            "identity": self._digest,
        }
        blob = _encode(header, payload)
        sizes = self._exchange_sizes(len(blob))
        need = len(blob) + sum(sizes[s] for s in self.held_for)
        ok = torch.tensor([1 if need <= self.max_bytes else 0])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self._pg)  # all ranks, or none
        if not ok.item():
            self.skipped = (
                f"state needs {need / 2**30:.3f} GiB > checkpoint.memory_max_GiB on some rank"
            )
            return False
        self._write(self._own(), blob)
        for src, data in self._exchange(blob, sizes).items():
            self._write(self._held(src), data)
        self.last_step, self.own_bytes = step, len(blob)
        self.held_bytes = sum(sizes[s] for s in self.held_for)
        self.last_snapshot_s = time.perf_counter() - t0
        return True

    def _exchange_sizes(self, n: int) -> list[int]:
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(sizes, torch.tensor([n], dtype=torch.int64), group=self._pg)
        return [int(s.item()) for s in sizes]

    def _exchange(self, blob: bytes, sizes: list[int]) -> dict[int, bytes]:
        """Send ``blob`` to this rank's holder; receive the blobs of the ranks it holds for."""
        if self.holder is None:
            return {}
        ops = [
            dist.P2POp(
                dist.isend,
                torch.frombuffer(bytearray(blob), dtype=torch.uint8),
                self.holder,
                self._pg,
            )
        ]
        bufs = {src: torch.empty(sizes[src], dtype=torch.uint8) for src in self.held_for}
        ops += [dist.P2POp(dist.irecv, b, src, self._pg) for src, b in bufs.items()]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return {src: b.numpy().tobytes() for src, b in bufs.items()}

    # ---- restore -------------------------------------------------------------------------
    def _inventory(self) -> dict[str, Any]:
        own = self._read(self._own())
        self._own_blob = own[2] if own else None  # verified: _transfer need not read it again
        held = {}
        for src in self.held_for:
            got = self._read(self._held(src))
            if got and got[0]["rank"] == src:
                held[src] = got[0]["step"]
        own_step = own[0]["step"] if own and own[0]["rank"] == self.rank else None
        return {"own": own_step, "held": held}

    def plan(self, storage_step: int | None) -> tuple[int | None, list[Any]]:
        """(step, source of every rank: "own" or the holder's rank) of the newest step every rank
        can restore, not older than ``storage_step``; (None, []) if there is none. Collective."""
        if self.off:  # every rank agreed: nothing to gather, storage serves
            return None, []
        inv: list[Any] = [None] * self.world
        dist.all_gather_object(inv, self._inventory(), group=self._pg)
        self.inventory = inv  # what every rank held, for the run's events
        steps = sorted({i["own"] for i in inv if i["own"] is not None}, reverse=True)
        for s in steps:
            if storage_step is not None and s < storage_step:
                break
            sources: list[Any] = []
            for r in range(self.world):
                if inv[r]["own"] == s:
                    sources.append("own")
                    continue
                holders = [h for h in range(self.world) if inv[h]["held"].get(r) == s]
                if not holders:
                    break
                sources.append(holders[0])
            if len(sources) == self.world:
                return s, sources
        return None, []

    def restore(self, state: Mapping[str, Any], storage_step: int | None) -> dict[str, Any] | None:
        """Load the newest consistent in-memory step into ``state``; what was loaded from where
        ({"step", "from_peer": ranks restored from a replica}), or None (load from storage)."""
        step, sources = self.plan(storage_step)
        if step is None:
            return None
        blob = self._transfer(sources)
        got = _decode(blob, self._digest)  # checksum again: a replica crossed the network
        # a file changed underneath: refuse, all together
        bad = torch.tensor([int(got is None or got[0]["step"] != step)])
        dist.all_reduce(bad, group=self._pg)
        if bad.item():
            return None
        saved = torch.load(io.BytesIO(got[1]), weights_only=True)
        sds = _state_dicts(state)
        for key, obj in state.items():
            if hasattr(obj, "load_state_dict"):
                obj.load_state_dict(_fill(sds[key], saved[key], key))
        self.last_step = step
        return {"step": step, "from_peer": [r for r, s in enumerate(sources) if s != "own"]}

    def _transfer(self, sources: list[Any]) -> bytes:
        """This rank's blob: its own file, or received from its holder (who sends it)."""
        mine = b""
        if sources[self.rank] == "own":
            mine = self._own_blob or self._own().read_bytes()
        self._own_blob = None
        ops, recv = [], None
        for r, s in enumerate(sources):
            if s == "own":
                continue
            if r == self.rank:
                size = torch.zeros(1, dtype=torch.int64)
                dist.recv(size, src=s, group=self._pg)
                recv = torch.empty(int(size.item()), dtype=torch.uint8)
                ops.append(dist.P2POp(dist.irecv, recv, s, self._pg))
            elif s == self.rank:
                data = self._held(r).read_bytes()
                dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=r, group=self._pg)
                ops.append(
                    dist.P2POp(
                        dist.isend,
                        torch.frombuffer(bytearray(data), dtype=torch.uint8),
                        r,
                        self._pg,
                    )
                )
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        if recv is not None:
            mine = recv.numpy().tobytes()
            self._write(self._own(), mine)  # this rank holds its own copy again
        return mine

    # ---- report / teardown ---------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """What the tier costs on this rank and where its replica lives."""
        return {
            "last_step": self.last_step,
            "own_bytes": self.own_bytes,
            "held_bytes": self.held_bytes,
            "max_bytes": self.max_bytes,
            "holder_rank": self.holder,
            "holds_for_ranks": self.held_for,
            "cross_node": self.placement.cross_node,
            "snapshot_s": self.last_snapshot_s,
            "skipped": self.skipped,
        }

    def discard(self) -> None:
        """The run is over: free this rank's memory (its own copy and the replicas it holds)."""
        if self.off:  # not ours to clean
            return
        for path in [self._own(), *(self._held(s) for s in self.held_for)]:
            path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.dir.rmdir()

    def drop_own(self) -> None:
        """Forget this rank's own copy (a drill: the node's memory lost with the rank)."""
        if self.off:
            return
        self._own().unlink(missing_ok=True)

    def close(self) -> None:
        if self._pg is not None and dist.is_initialized():
            dist.destroy_process_group(self._pg)
        self._pg = None


def remove_all(run_dir: Path) -> None:
    """Drop every memory file of a run on this node (e.g. to drill a lost node)."""
    folder = shm_root() / f"aihpc-{memory_key(run_dir)}"
    if private_dir(folder, create=False) is None:  # never a neighbour's folder or a link
        shutil.rmtree(folder, ignore_errors=True)
