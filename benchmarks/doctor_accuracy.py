"""How often `aihpc doctor` is right on its corpus, and whether it quotes a line for every claim:
each case of tests/observe/corpus (cases.toml says what it must conclude) diagnosed end to end.

    python benchmarks/doctor_accuracy.py --results benchmarks/results
    python benchmarks/doctor_accuracy.py                    # ./benchmark-results/

Per case: the first failure's class; its rank and node where the case names them; the ranks that
had not joined (right, wrong, or "unknown" where the case expects a proof or where the logs hold
none); and whether every claim (the first failure, a rank or node lent from another line, each
rank named as not joined) comes with a quoted line that is really at that file:line (a flight-
recorder dump is quoted by its file). The corpus is ours, written in the tools' exact formats;
a score on it is a regression figure, not a field accuracy.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tomllib
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import add_results_arg, save

from aihpc.observe.doctor import diagnose

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "observe" / "corpus"


def _quoted(d) -> bool:
    """Every evidence line is at its file:line; the cause and each not-joined rank have one."""
    evidence = getattr(d, "evidence", None)
    if evidence is None:
        return False
    for ev in evidence:
        if ev["line"]:
            lines = Path(ev["file"]).read_text(errors="replace").splitlines()
            if ev["line"] > len(lines) or lines[ev["line"] - 1].strip()[:400] != ev["text"]:
                return False
        elif not Path(ev["file"]).is_file():
            return False
    claims = " | ".join(ev["claim"] for ev in evidence)
    if d.cause is not None and not evidence:
        return False
    return all(f"rank {r} had not joined" in claims for r in d.not_joined)


def _not_joined(case: dict, d) -> str | None:
    """right / wrong / unknown (said unknown where a proof exists) / None (not a wait)."""
    want = case.get("not_joined")
    if want is None:
        return None
    state = getattr(d, "not_joined_state", None)
    if want == "unknown":
        return "right" if not d.not_joined and state == "unknown" else "wrong"
    if d.not_joined == want and (want or state == case.get("not_joined_state", state)):
        return "right"
    if not d.not_joined and state == "unknown":
        return "unknown"
    return "wrong"


def evaluate(name: str, case: dict) -> dict:
    d = diagnose([CORPUS / name])
    row = {
        "case": name,
        "expected": case["class"],
        "got": d.cls,
        "class_right": d.cls == case["class"],
    }
    for key in ("rank", "node"):
        if key in case:
            got = getattr(d.cause, key, None) if d.cause else None
            row[f"{key}_right"] = got == case[key]
    row["not_joined"] = _not_joined(case, d)
    row["evidence_quoted"] = _quoted(d)
    row["claims"] = len(getattr(d, "evidence", []) or [])
    row["summary"] = d.summary
    return row


def _count(rows: list[dict], key: str) -> tuple[int, int]:
    vals = [r[key] for r in rows if key in r]
    return sum(1 for v in vals if v), len(vals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_results_arg(ap)
    args = ap.parse_args()
    cases = tomllib.loads((CORPUS / "cases.toml").read_text())
    rows = [evaluate(name, cases[name]) for name in sorted(cases)]
    nj = [r["not_joined"] for r in rows if r["not_joined"] is not None]
    totals = {
        "cases": len(rows),
        "class_right": _count(rows, "class_right"),
        "rank_right": _count(rows, "rank_right"),
        "node_right": _count(rows, "node_right"),
        "not_joined_cases": len(nj),
        "not_joined_right": nj.count("right"),
        "not_joined_wrong": nj.count("wrong"),
        "not_joined_unknown_where_provable": nj.count("unknown"),
        "evidence_quoted": _count(rows, "evidence_quoted"),
    }
    data = {
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        },
        "totals": totals,
        "cases": rows,
    }

    def frac(pair: tuple[int, int]) -> str:
        return f"{pair[0]}/{pair[1]}"

    table = (
        "| cases | first-failure class | rank | node | not joined: right / wrong / unknown "
        "| every claim quoted |\n|---|---|---|---|---|---|\n"
        f"| {len(rows)} | {frac(totals['class_right'])} | {frac(totals['rank_right'])} | "
        f"{frac(totals['node_right'])} | {totals['not_joined_right']} / "
        f"{totals['not_joined_wrong']} / {totals['not_joined_unknown_where_provable']} "
        f"(of {len(nj)}) | {frac(totals['evidence_quoted'])} |\n\n"
        "| case | expected | got | rank | node | not joined | quoted |\n"
        "|---|---|---|---|---|---|---|\n"
        + "\n".join(
            f"| {r['case']} | {r['expected']} | {r['got']} | "
            f"{_mark(r.get('rank_right'))} | {_mark(r.get('node_right'))} | "
            f"{r['not_joined'] or '-'} | {_mark(r['evidence_quoted'])} |"
            for r in rows
        )
    )
    save("doctor_accuracy", data, table, args.results)


def _mark(v: bool | None) -> str:
    return "-" if v is None else ("yes" if v else "NO")


if __name__ == "__main__":
    main()
