"""Every file of the import corpus imports to the fields cases.toml lists, or is refused with
the reason it lists (issue 36 item 1)."""

from __future__ import annotations

import pytest
from corpus_cases import CORPUS, cases, judge


@pytest.mark.parametrize("case", cases(), ids=lambda c: c["id"])
def test_corpus_file_imports_as_listed(case: dict) -> None:
    verdict, detail = judge(case)
    assert verdict == ("refused" if "refuse" in case else "right"), detail


def test_every_corpus_file_has_a_case() -> None:
    files = {
        str(p.relative_to(CORPUS))
        for p in CORPUS.rglob("*")
        if p.suffix in (".sh", ".toml", ".json")
    }
    files.discard("cases.toml")
    assert files == {c["file"] for c in cases()}
    assert len(files) >= 25
