"""Count the file-system operations a process makes under one folder, through Python's audit
hooks (PEP 578), so a crash drill can kill a checkpoint save at *every* operation it makes.

Counted: opening a file for writing, rename / replace, remove, rmdir, mkdir and truncate — the
operations Python audits that change the tree. ``fsync`` and ``write`` are not audited, so a kill
"at" an operation lands before it, after every earlier write. The hook sees every thread, so an
async save's background writes and commits are counted in the order they happen, DCP's own file
writes included. Audit hooks cannot be removed; this one is installed once per process and does
nothing until a watch is armed.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["FsOpWatch", "watch_fs_ops"]

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PATH_EVENTS = {"os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.truncate"}


class FsOpWatch:
    """Calls ``on_op(index, description)`` for each counted operation under ``root``."""

    def __init__(self, root: Path, on_op: Callable[[int, str], None]) -> None:
        self.root = str(Path(root).resolve())
        self.on_op = on_op
        self.count = 0
        self._lock = threading.Lock()

    def seen(self, event: str, path: str) -> None:
        if not (path == self.root or path.startswith(self.root + os.sep)):
            return
        with self._lock:
            self.count += 1
            index = self.count
        self.on_op(index, f"{event} {os.path.relpath(path, self.root)}")


_watches: list[FsOpWatch] = []
_installed = False
_busy = threading.local()


def watch_fs_ops(root: Path, on_op: Callable[[int, str], None]) -> FsOpWatch:
    """Start counting operations under ``root`` (from 0), calling ``on_op`` for each."""
    global _installed
    watch = FsOpWatch(root, on_op)
    _watches.append(watch)
    if not _installed:
        sys.addaudithook(_hook)
        _installed = True
    return watch


def _resolve(path: Any, dir_fd: Any = None) -> str | None:
    if isinstance(path, int):  # a file descriptor (os.truncate(fd, n))
        try:
            return os.readlink(f"/proc/self/fd/{path}")
        except OSError:
            return None
    try:
        text = os.fsdecode(path)
    except TypeError:
        return None
    if not os.path.isabs(text):
        base = os.getcwd()
        if isinstance(dir_fd, int) and dir_fd >= 0:  # -1 is "no dir_fd" in audit events
            try:
                base = os.readlink(f"/proc/self/fd/{dir_fd}")
            except OSError:
                return None
        text = os.path.join(base, text)
    return os.path.normpath(text)


def _mutating_open(args: tuple[Any, ...]) -> bool:
    _, mode, flags = args
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return isinstance(flags, int) and bool(flags & _WRITE_FLAGS)


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if not _watches or getattr(_busy, "on", False):
        return
    if event == "open" and len(args) == 3 and _mutating_open(args):
        paths = [_resolve(args[0])]
    elif event == "os.rename":
        paths = [_resolve(args[0], args[2])]  # (src, dst, src_dir_fd, dst_dir_fd)
    elif event in _PATH_EVENTS:
        dir_fd = args[-1] if event in ("os.remove", "os.rmdir", "os.mkdir") else None
        paths = [_resolve(args[0], dir_fd)]
    else:
        return
    _busy.on = True  # readlink and the callbacks must not count themselves
    try:
        for path in paths:
            if path is not None:
                for watch in list(_watches):
                    watch.seen(event, path)
    finally:
        _busy.on = False
