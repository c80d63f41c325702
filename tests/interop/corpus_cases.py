"""The import corpus (tests/interop/corpus, cases.toml): each file imported as `aihpc import`
does, and judged: right (every listed field and note as the case says), refused with the true
reason (the case's substring in the one-line refusal), or wrong (with what differed). Shared by
tests/interop/test_import_corpus.py and benchmarks/import_corpus.py."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from aihpc.interop import import_deepspeed, import_megatron, import_torchtitan
from aihpc.runspec import SpecError

CORPUS = Path(__file__).resolve().parent / "corpus"
_READERS = {"megatron": import_megatron, "torchtitan": import_torchtitan}


def cases(corpus: Path = CORPUS) -> list[dict[str, Any]]:
    out = tomllib.loads((corpus / "cases.toml").read_text())["case"]
    for c in out:
        c.setdefault("id", c["file"])
    return out


def _field(spec: Any, path: str) -> Any:
    table, name = path.split(".", 1)
    if table == "parallel":
        return getattr(spec.plan(), name)
    return getattr(getattr(spec, table), name)


def judge(case: dict[str, Any], corpus: Path = CORPUS) -> tuple[str, str]:
    """(verdict, detail): verdict right | refused | wrong. `refuse` is a substring of the
    refusal, or a list of alternatives (any one names the true reason)."""
    text = (corpus / case["file"]).read_text()
    framework = case["file"].split("/", 1)[0]
    args = dict(case.get("args", {}))
    try:
        if framework == "deepspeed":
            imported = import_deepspeed(text, **args)
        else:
            imported = _READERS[framework](text, **args)
        spec = imported.spec()
    except SpecError as e:
        want = case.get("refuse", [])
        if any(w in str(e) for w in ([want] if isinstance(want, str) else want)):
            return "refused", str(e)
        return "wrong", f"refused: {e}"
    except Exception as e:  # a traceback is a wrong answer, named
        return "wrong", f"{type(e).__name__}: {e}"
    if "refuse" in case:
        return "wrong", f"imported; must refuse ({case['refuse']})"
    wrong = []
    for path, want in case.get("expect", {}).items():
        got = _field(spec, path)
        if got != want:
            wrong.append(f"{path} = {got!r}, expected {want!r}")
    for note in case.get("notes", []):
        if not any(note in n for n in imported.notes):
            wrong.append(f"no note containing {note!r}")
    return ("wrong", "; ".join(wrong)) if wrong else ("right", "")
