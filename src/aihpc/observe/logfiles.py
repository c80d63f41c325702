"""Which files ``aihpc doctor`` reads, and how: the files named, the files in a folder named
(bounded in count and bytes), binaries skipped, text streamed a bounded line at a time."""

from __future__ import annotations

import gzip
import os
import stat
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aihpc.runspec.errors import SpecError

__all__ = [
    "MAX_FOLDER_BYTES",
    "MAX_FOLDER_FILES",
    "MAX_LINE_CHARS",
    "binary",
    "expand",
    "open_text",
]


# A log line longer than this is cut there (what matters of a line is near its start) and the
# rest of it skipped as the file is read, a block at a time: a 1 GiB line without a newline (a
# binary stream, a progress bar) is read in bounded memory.
MAX_LINE_CHARS = 64 << 10


def open_text(path: Path) -> Iterator[str]:
    """The file's lines (``\\n``-ended but the last), each at most MAX_LINE_CHARS long. Read in
    blocks split in C: as fast as iterating the file, whose lines have no length bound."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", errors="replace") as f:  # type: ignore[operator]
        try:
            yield from _bounded_lines(f)
        except (zlib.error, EOFError) as err:  # a damaged or cut .gz: unreadable, as a bad
            raise OSError(f"damaged or truncated gzip data ({err})") from err  # header is


_BLOCK_CHARS = 1 << 20


def _bounded_lines(f: Any) -> Iterator[str]:
    carry, cut = "", False  # the start of a line not ended yet; whether it passed the bound
    while block := f.read(_BLOCK_CHARS):
        parts = block.split("\n")
        if len(parts) > 1:
            yield (carry if cut else carry + parts[0])[:MAX_LINE_CHARS] + "\n"
            for part in parts[1:-1]:
                yield part[:MAX_LINE_CHARS] + "\n" if len(part) > MAX_LINE_CHARS else part + "\n"
            carry, cut = parts[-1], False
        elif not cut:
            carry += parts[0]
        if len(carry) > MAX_LINE_CHARS:
            carry, cut = carry[:MAX_LINE_CHARS], True
    if carry:
        yield carry


# A folder is read as the regular files under it (symbolic links not followed), at most this
# many and this many bytes: a job's logs, its events.jsonl and dumps, a run directory with its
# checkpoint shards (skipped as binary) fit; a home folder or / is refused in one line, not
# read for an hour.
MAX_FOLDER_FILES = 10_000
MAX_FOLDER_BYTES = 4 << 30
_PSEUDO = ("/proc", "/sys", "/dev")


def _folder_files(folder: Path) -> list[Path]:
    if str(folder.resolve()).startswith(_PSEUDO):
        raise SpecError("LOG", str(folder), "a kernel pseudo-filesystem, not logs")
    files: list[Path] = []
    seen = size = 0
    for root, dirs, names in os.walk(folder):  # never follows a link to a folder
        dirs.sort()
        seen += len(dirs) + len(names)
        for name in sorted(names):
            q = Path(root) / name
            try:
                st = q.lstat()
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                files.append(q)
                size += st.st_size
        if seen > MAX_FOLDER_FILES or size > MAX_FOLDER_BYTES:
            raise SpecError(
                "LOG",
                str(folder),
                f"holds more than {MAX_FOLDER_FILES:,} entries or {MAX_FOLDER_BYTES >> 30} GiB; "
                "name the job's log files, or the folder that holds only them",
            )
    return files


def expand(paths: list[Path]) -> list[Path]:
    """The files to read: each file named, and the files in each folder named. Anything but a
    regular file or a folder (a FIFO, a device) would block or never end: one line."""
    out: list[Path] = []
    for p in paths:
        if os.path.isdir(p):
            out += _folder_files(p)
        elif os.path.isfile(p):
            out.append(p)
        else:
            raise SpecError("LOG", str(p), "not a regular file or a folder")
    return out


def binary(path: Path) -> bool:
    """Checkpoint shards and other binaries in a run directory: a NUL byte near the start of an
    uncompressed file (gzip is text once opened)."""
    if path.suffix == ".gz":
        return False
    try:
        with open(path, "rb") as f:
            return b"\0" in f.read(4096)
    except OSError:
        return False
