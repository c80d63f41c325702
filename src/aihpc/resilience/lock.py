"""One job per run directory: an OS lock that dies with its holder.

``flock`` on ``RUN_DIR/LOCK`` is released by the kernel when the holding process exits, however
it exits (SIGKILL, OOM kill, node reboot of a local disk), so a crashed job never needs a manual
unlock. The holder writes who it is (PID, host, start time, command) into the file after it has
the lock, and a second job is answered with that line. The file is opened without truncation
so that a job that fails to get the lock never erases the holder's record.

On a shared file system the lock is only as good as the file system's ``flock``: Linux NFS
(v3 with lockd, v4) maps it to a byte-range lock that other clients see; Lustre needs the
``flock`` mount option (without it ``flock`` fails with ENOSYS, which is reported, not ignored).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["LOCK_NAME", "RunDirBusyError", "RunDirLock"]

LOCK_NAME = "LOCK"


class RunDirBusyError(RuntimeError):
    """Another live process holds the run directory; ``holder`` is what it wrote about itself."""

    def __init__(self, run_dir: Path, holder: dict[str, Any] | None) -> None:
        self.run_dir = run_dir
        self.holder = holder or {}
        super().__init__(self.describe())

    def describe(self) -> str:
        h = self.holder
        if not h.get("pid"):
            return "is in use by another aihpc job (its LOCK record is unreadable)"
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.get("started_unix", 0)))
        return (
            f"is in use by PID {h['pid']} on host {h.get('host', '?')} since {since}; "
            "wait for that job to end or use another --run-dir"
        )


class RunDirLock:
    """``with RunDirLock(run_dir): ...`` holds the directory for this process (not inherited by
    children started with ``close_fds``, the subprocess default). Raises RunDirBusyError."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> RunDirLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunDirBusyError(self.path.parent, holder) from None
        except OSError:
            os.close(fd)
            raise
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_unix": time.time(),
            "command": " ".join(sys.argv),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> RunDirLock:
        return self if self._fd is not None else self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_holder(fd: int) -> dict[str, Any] | None:
    try:
        data = os.pread(fd, 4096, 0).decode()
        holder = json.loads(data)
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None
