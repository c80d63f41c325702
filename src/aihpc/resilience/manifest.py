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
    "CheckpointCorruptError",
    "CheckpointInfo",
    "CheckpointMismatchError",
    "check_identity",
    "committed_checkpoints",
    "fsync_dir",
    "manifest_bytes",
    "read_manifest",
    "read_pointer",
    "sha256_file",
    "verify_checkpoint",
    "write_atomic",
]

log = logging.getLogger("aihpc.resilience")

MANIFEST = "MANIFEST.json"
POINTER = "LATEST"
STEP_DIR = re.compile(r"^step_(\d{8,})$")
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


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint folder ``path``; CheckpointCorruptError if it is unreadable."""
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError("files is not a table")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointCorruptError(f"{manifest_path}: unreadable manifest ({err})") from err
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
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError) as err:
        return None, f"{path}: unreadable ({err}); ignored"
    m = STEP_DIR.match(text)
    if not m:
        return None, f"{path}: says {text[:40]!r}, not a checkpoint name; ignored"
    step = int(m.group(1))
    if step not in {c.step for c in committed}:
        return step, f"{path}: names {text}, which is not a committed checkpoint"
    return step, None


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
