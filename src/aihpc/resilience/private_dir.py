"""A folder only this user can use, in a place every user can write (``/dev/shm``).

``/dev/shm`` is shared by everyone on the node (mode 1777: anyone creates, only the owner
removes). A neighbour who guesses the name of a folder we will use can create it first, as a
folder of theirs, one open to all, or a symbolic link to a place of theirs, and so read our
state or feed us one. ``private_dir`` creates the folder 0700 (``mkdir`` never follows a link)
or, when it is there, opens it without following a link (``O_NOFOLLOW``) and checks what it
opened: a folder, owned by this user, that no one else can write. A folder of ours that
others can only read is closed to them (0700); anything else is refused, with the reason.
Once it passes, no one else can add, remove or swap anything in it: the sticky bit keeps the
folder ours (a parent others may write into without it is refused), its mode keeps its
entries ours.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

__all__ = ["private_dir"]


def private_dir(path: Path, create: bool = True) -> str | None:
    """Make ``path`` (or, with ``create=False``, find it) a folder only this user can use;
    None when it is, else why it must not be used (one phrase)."""
    if create:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass  # someone's: checked below
        except OSError as err:
            return f"cannot be created ({err.strerror})"
    parent = _swappable_parent(path.parent)
    if parent is not None:
        return parent
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as err:
        if err.errno == errno.ELOOP:
            return "is a symbolic link"
        if err.errno == errno.ENOTDIR:
            return "is not a folder"
        return f"cannot be opened ({err.strerror})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):
            return "is not a folder"
        if st.st_uid != os.getuid():
            return f"is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o022:
            return f"is writable by others (mode {mode:04o}; 0700 expected)"
        if mode & 0o077:
            os.fchmod(fd, 0o700)  # ours, and no one else could write into it: close it
    finally:
        os.close(fd)
    return None


def _swappable_parent(parent: Path) -> str | None:
    """Why another user could rename our folder away and put theirs in its place, if they
    could: a parent they may write into without the sticky bit (``/dev/shm`` has it)."""
    try:
        st = os.stat(parent)
    except OSError as err:
        return f"is in {parent}, which cannot be read ({err.strerror})"
    if st.st_mode & stat.S_ISVTX:
        return None
    if st.st_uid not in (0, os.getuid()) or st.st_mode & 0o022:
        return f"is in {parent}, where others may replace it (writable, no sticky bit)"
    return None
