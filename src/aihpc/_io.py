"""Writing a user's output file: whole or not at all, with the permissions a plain open() gives.

``tempfile.mkstemp`` creates its file readable by its owner only (0600); renaming it into
place would leave a calibration, a benchmark JSON or a plot that nobody else on a shared
cluster can read. These helpers give the file ``0666 & ~umask``, as ``open(path, "w")`` does.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aihpc.runspec.errors import SpecError

__all__ = ["atomic_target", "check_output_path", "json_safe", "to_json", "write_atomic"]


def json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float (nan, inf) replaced by None: strict JSON has no
    NaN or Infinity, and most parsers outside Python refuse them."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def to_json(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` that never writes NaN or Infinity (they become null)."""
    return json.dumps(json_safe(obj), allow_nan=False, **kwargs)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_output_path(path: Path, field: str, suffix: str | None = None) -> None:
    """Refuse, before any work, an output path that cannot become a file (exit 2, one line).

    Its folder must exist: it is never created silently, since a typo in a folder name would
    otherwise put the file where nobody looks (``--plot``, ``-O``/``--output`` alike).
    """
    if suffix is not None and path.suffix.lower() != suffix:
        raise SpecError(field, str(path), f"must be a {suffix} file name")
    # os.path's tests, not Path's: False for a name the system cannot look up (too long),
    # where Path.is_dir raises OSError
    if os.path.isdir(path):
        raise SpecError(field, str(path), "is a directory; expected a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not os.path.isdir(parent):
        raise SpecError(field, str(path), f"folder {str(parent)!r} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise SpecError(field, str(path), f"folder {str(parent)!r} is not writable")


@contextlib.contextmanager
def atomic_target(path: Path, field: str) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path``, else it goes.

    Any OS error (no permission, a directory in the way, a full disk) becomes a SpecError naming
    ``field``, and no partial file is left behind.
    """
    check_output_path(path, field)
    try:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
    except OSError as err:
        raise SpecError(field, str(path), f"cannot be written ({err.strerror})") from err
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except OSError as err:
        raise SpecError(field, str(path), f"cannot be written ({err.strerror})") from err
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_atomic(path: Path, text: str, field: str = "--output") -> None:
    """Write ``text`` to ``path`` whole or not at all (a temporary file beside it, renamed)."""
    with atomic_target(path, field) as tmp:
        tmp.write_text(text)
