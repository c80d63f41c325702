"""observe/logfiles.py: a log is read as the lines iterating the file gives, each cut at
MAX_LINE_CHARS, in bounded memory whatever the file holds."""

from __future__ import annotations

import gzip
import random
from pathlib import Path

import pytest

from aihpc.observe import logfiles
from aihpc.observe.logfiles import open_text


@pytest.mark.parametrize("seed", range(6))
def test_lines_are_the_files_own(seed: int, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(logfiles, "_BLOCK_CHARS", 7)  # many lines across block edges
    rng = random.Random(seed)
    text = "".join(rng.choice(["a", "b", "\n", "\r\n", "é", " "]) for _ in range(3000))
    path = tmp_path / "x.log"
    path.write_text(text, newline="")
    with open(path, errors="replace") as f:
        assert list(open_text(path)) == list(f)


def test_a_long_line_is_cut_and_the_rest_read(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(logfiles, "_BLOCK_CHARS", 1000)
    cap = logfiles.MAX_LINE_CHARS
    path = tmp_path / "x.log.gz"
    with gzip.open(path, "wt") as f:
        f.write("first\n" + "y" * (cap * 3 + 5) + "\nXid 79\n" + "z" * (cap + 1))
    lines = list(open_text(path))
    assert lines == ["first\n", "y" * cap + "\n", "Xid 79\n", "z" * cap]
