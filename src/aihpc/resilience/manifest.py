"""What a committed checkpoint is, checked without torch: its manifest, its files, the LATEST
pointer, and the run spec that wrote it.

A folder ``step_NNNNNNNN/`` is committed when it holds ``MANIFEST.json``; the manifest lists the
SHA-256 and size of *every other file in the folder* and names the run that wrote it. A folder
whose manifest lists no file, lists a file that is missing or different, or misses a file that is
there, is corrupt; a step folder without a manifest is not a checkpoint and is named, never
skipped in silence.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aihpc.runspec import SpecError

__all__ = [
    "MANIFEST",
    "POINTER",
    "QUARANTINE",
    "CheckpointCorruptError",
    "CheckpointInfo",
    "CheckpointMismatchError",
    "Scan",
    "check_identity",
    "committed_checkpoints",
    "fsync_dir",
    "manifest_bytes",
    "manifest_problem",
    "point_latest",
    "quarantine",
    "read_manifest",
    "read_pointer",
    "scan_checkpoints",
    "settle",
    "sha256_file",
    "verify_checkpoint",
    "write_atomic",
]

log = logging.getLogger("aihpc.resilience")

MANIFEST = "MANIFEST.json"
POINTER = "LATEST"
STEP_DIR = re.compile(r"^step_(\d{8,})$")
QUARANTINE = "corrupt"  # corrupt checkpoints passed over by a fallback are moved here, kept
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# 2: optimizer state flattened to one entry per parameter name (reshards across pipeline plans)
FORMAT = "aihpc-checkpoint-2"


class CheckpointCorruptError(RuntimeError):
    """A committed checkpoint whose files do not match its manifest (the message names the file)."""


class CheckpointMismatchError(SpecError):
    """The checkpoint was written by a run spec whose model, data or seed differ from this one."""

    def __init__(self, path: Path, differences: list[str]) -> None:
        self.differences = differences
        super().__init__(
            "checkpoint",
            str(path),
            "was written by a different run (" + "; ".join(differences) + "); resume it with "
            "the spec that wrote it, or start this one in a new --run-dir",
        )


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def manifest_problem(manifest: Any, folder: Path) -> str | None:
    """What is wrong with the parsed MANIFEST.json of checkpoint ``folder`` (None: sound): it
    is a table whose ``files`` maps each file name of the folder to its ``sha256`` (64 hex
    digits) and ``size`` (bytes), whose ``step`` is the folder's and whose ``run`` a table."""
    if not isinstance(manifest, dict):
        return f"a JSON {type(manifest).__name__}, not a table"
    files = manifest.get("files")
    if not isinstance(files, dict):
        return f"files = {_show(files)}, not a table of file name to sha256 and size"
    for name, meta in files.items():
        if name in ("", ".", "..", MANIFEST) or "/" in name or "\0" in name:
            return f"files lists {name!r}, not a file of the checkpoint folder"
        if not isinstance(meta, dict):
            return f"files[{name!r}] = {_show(meta)}, not a table of sha256 and size"
        digest, size = meta.get("sha256"), meta.get("size")
        if not (isinstance(digest, str) and _SHA256.match(digest)):
            return f"files[{name!r}].sha256 = {_show(digest)}, not 64 hex digits"
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            return f"files[{name!r}].size = {_show(size)}, not a size in bytes"
    m, step = STEP_DIR.match(folder.name), manifest.get("step")
    if m and "step" in manifest and (isinstance(step, bool) or step != int(m.group(1))):
        return f"step = {_show(step)}, but the folder is {folder.name}"
    if not isinstance(manifest.get("run", {}), dict):
        return f"run = {_show(manifest['run'])}, not a table"
    return None


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint folder ``path``; CheckpointCorruptError if it is unreadable
    or not what a commit writes (``manifest_problem``)."""
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_bytes())
    except (OSError, ValueError, RecursionError) as err:
        raise CheckpointCorruptError(f"{manifest_path}: unreadable manifest ({err})") from err
    problem = manifest_problem(manifest, path)
    if problem:
        raise CheckpointCorruptError(f"{manifest_path}: {problem}")
    return manifest


def manifest_bytes(path: Path) -> int:
    """Bytes the manifest of ``path`` lists (0 when it cannot be read)."""
    try:
        return sum(int(m["size"]) for m in read_manifest(path)["files"].values())
    except (CheckpointCorruptError, KeyError, TypeError, ValueError):
        return 0


def verify_checkpoint(path: str | Path) -> None:
    """Check the folder against MANIFEST.json: every file listed, present and matching, and no
    file the manifest does not list. Raise CheckpointCorruptError naming the bad file."""
    path = Path(path)
    files = read_manifest(path)["files"]
    if not files:
        raise CheckpointCorruptError(f"{path / MANIFEST}: lists no files, so it verifies nothing")
    present = {f.name for f in path.iterdir() if f.name != MANIFEST}
    unlisted = sorted(present - set(files))
    if unlisted:
        raise CheckpointCorruptError(f"{path / unlisted[0]}: not listed in {MANIFEST}")
    for name, meta in sorted(files.items()):
        f = path / name
        if not f.is_file():
            raise CheckpointCorruptError(f"{f}: missing (listed in {MANIFEST})")
        size = f.stat().st_size
        if size != meta["size"]:
            raise CheckpointCorruptError(
                f"{f}: size {size} bytes, manifest says {meta['size']} (truncated or overwritten)"
            )
        digest = sha256_file(f)
        if digest != meta["sha256"]:
            raise CheckpointCorruptError(
                f"{f}: SHA-256 {digest[:16]}… does not match the manifest's {meta['sha256'][:16]}…"
            )


def committed_checkpoints(root: Path) -> tuple[list[CheckpointInfo], list[str]]:
    """Committed checkpoints under ``root`` (oldest first, not verified), and one line for each
    step folder that has no manifest (a deleted or never-written MANIFEST.json)."""
    out, problems = [], []
    if not root.is_dir():
        return out, problems
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if not (m and p.is_dir()):
            continue
        if (p / MANIFEST).is_file():
            out.append(CheckpointInfo(int(m.group(1)), p))
        else:
            problems.append(f"{p}: no {MANIFEST}, so it is not a checkpoint; skipped")
    return sorted(out, key=lambda c: c.step), sorted(problems)


def read_pointer(root: Path, committed: list[CheckpointInfo]) -> tuple[int | None, str | None]:
    """The step ``LATEST`` names, checked against the committed folders: (step, problem)."""
    path = root / POINTER
    if not path.exists() and not path.is_symlink():
        return None, None
    if not path.is_file():
        kind = "a folder" if path.is_dir() else "a broken link" if path.is_symlink() else "odd"
        return None, f"{path}: {kind}, not a file naming a checkpoint"
    try:
        with open(path, "rb") as f:
            text = f.read(256).decode().strip()
    except (OSError, UnicodeDecodeError) as err:
        return None, f"{path}: unreadable ({err})"
    m = STEP_DIR.match(text)
    if not m:
        return None, f"{path}: says {text[:40]!r}, not a checkpoint name"
    step = int(m.group(1))
    if step not in {c.step for c in committed}:
        return step, f"{path}: names {text}, which is not a committed checkpoint"
    return step, None


@dataclass(frozen=True)
class Scan:
    """What a load finds under a checkpoint root: the newest intact checkpoint, the corrupt
    ones newer than it (newest first, each with what is wrong), step folders that are not
    checkpoints, and what is wrong with ``LATEST``."""

    intact: CheckpointInfo | None
    corrupt: tuple[tuple[CheckpointInfo, str], ...]
    not_checkpoints: tuple[str, ...]
    pointer_problem: str | None

    def lines(self) -> list[str]:
        """One line for each problem, as found (nothing acted on)."""
        pointer = [self.pointer_problem] if self.pointer_problem else []
        return [*self.not_checkpoints, *pointer, *(why for _, why in self.corrupt)]


def scan_checkpoints(root: Path, verify: bool = True) -> Scan:
    """Verify committed checkpoints newest first until one is intact (``verify`` False: the
    newest is taken as it is)."""
    committed, not_checkpoints = committed_checkpoints(root)
    _, pointer_problem = read_pointer(root, committed)
    corrupt: list[tuple[CheckpointInfo, str]] = []
    for info in reversed(committed):
        try:
            if verify:
                verify_checkpoint(info.path)
        except CheckpointCorruptError as err:
            corrupt.append((info, f"checkpoint step {info.step} is corrupt: {err}"))
            continue
        return Scan(info, tuple(corrupt), tuple(not_checkpoints), pointer_problem)
    return Scan(None, tuple(corrupt), tuple(not_checkpoints), pointer_problem)


def quarantine(path: Path, root: Path) -> Path:
    """Move ``path`` into ``root/corrupt/`` under a free name: out of the scan, kept."""
    folder = root / QUARANTINE
    folder.mkdir(exist_ok=True)
    dest, n = folder / path.name, 1
    while dest.exists() or dest.is_symlink():
        n += 1
        dest = folder / f"{path.name}.{n}"
    os.replace(path, dest)
    fsync_dir(root)
    return dest


def point_latest(root: Path, name: str) -> Path | None:
    """Make ``LATEST`` name ``name``; something other than a file in its place is moved to
    ``corrupt/`` first (its new path returned), not deleted."""
    path, moved = root / POINTER, None
    if (path.exists() or path.is_symlink()) and not path.is_file():
        moved = quarantine(path, root)
    write_atomic(path, name.encode())
    return moved


def settle(root: Path, scan: Scan) -> list[str]:
    """After a load chose ``scan.intact``: each corrupt checkpoint newer than it is un-committed
    by moving it to ``corrupt/`` (kept for a person to look at; a later run never meets it
    again, nor counts it among those retention keeps), and ``LATEST`` names the checkpoint
    resumed from. One line for each problem, saying what was done."""
    assert scan.intact is not None
    lines = list(scan.not_checkpoints)
    resumed = f"resuming from step {scan.intact.step}"
    for info, why in scan.corrupt:
        dest = quarantine(info.path, root)
        lines.append(f"{why}; {resumed}, the folder kept as {dest.relative_to(root)}")
    pointer = root / POINTER
    named = pointer.is_file() and pointer.read_bytes().strip() == scan.intact.path.name.encode()
    if not named:
        moved = point_latest(root, scan.intact.path.name)
        if scan.pointer_problem:
            kept = f" (moved to {moved.relative_to(root)})" if moved else ""
            lines.append(f"{scan.pointer_problem}{kept}; now names {scan.intact.path.name}")
    return lines


def _flat(identity: Mapping[str, Any]) -> dict[str, str]:
    return {k: json.dumps(v, sort_keys=True) for k, v in identity.items()}


def check_identity(path: Path, current: Mapping[str, Any] | None) -> None:
    """Refuse (CheckpointMismatchError) a checkpoint of another format, or whose recorded run
    differs from ``current`` in any field (``current`` None: the format alone is checked)."""
    manifest = read_manifest(path)
    if manifest.get("format") != FORMAT:
        raise CheckpointMismatchError(
            path, [f"format {manifest.get('format')} → {FORMAT} (written by an older aihpc)"]
        )
    if current is None:
        return
    saved = manifest.get("run")
    if saved is None:
        log.warning("%s records no run identity; not checked", path.name)
        return
    old, new = _flat(saved), _flat(current)
    diffs = [
        f"{k} {old.get(k, 'unset')} → {new.get(k, 'unset')}"
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k)
    ]
    if diffs:
        raise CheckpointMismatchError(path, diffs)
