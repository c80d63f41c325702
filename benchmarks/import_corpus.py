"""How `aihpc import` does on its corpus of framework files: each file of tests/interop/corpus
(cases.toml says what it must import to, or the refusal it must give) imported end to end and
counted as imported right, refused with the true reason, or wrong (a wrong field, a missing
note, a false refusal, a traceback).

    python benchmarks/import_corpus.py --results benchmarks/results
    python benchmarks/import_corpus.py                    # ./benchmark-results/
    python benchmarks/import_corpus.py --corpus tests/interop/heldout --results benchmarks/results

--corpus DIR reads DIR/cases.toml and writes import_<DIR's name> (import_corpus for the default,
import_heldout for the held-out set, issue 36 item 1).

The corpus is ours, written in the frameworks' current formats (Megatron-LM examples/ and
recipes, torchtitan 0.2 job TOMLs, DeepSpeed JSONs for the HF Trainer); a score on it is a
regression figure, not a field accuracy.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "interop"))
from _common import add_results_arg, save
from corpus_cases import CORPUS, cases, judge


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_results_arg(ap)
    ap.add_argument(
        "--corpus", type=Path, default=CORPUS, help="folder with cases.toml (default: the corpus)"
    )
    args = ap.parse_args()
    corpus = args.corpus.resolve()
    rows = []
    for case in cases(corpus):
        verdict, detail = judge(case, corpus)
        rows.append(
            {
                "case": case["id"],
                "framework": case["file"].split("/", 1)[0],
                "expected": "refused" if "refuse" in case else "imported",
                "verdict": verdict,
                "fields_checked": len(case.get("expect", {})) + len(case.get("notes", [])),
                "detail": detail,
            }
        )
    totals = {
        "cases": len(rows),
        "imported_right": sum(r["verdict"] == "right" for r in rows),
        "refused_true_reason": sum(r["verdict"] == "refused" for r in rows),
        "wrong": sum(r["verdict"] == "wrong" for r in rows),
        "fields_checked": sum(r["fields_checked"] for r in rows),
    }
    data = {
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        },
        "corpus": str(corpus.relative_to(Path(__file__).resolve().parents[1]))
        if corpus.is_relative_to(Path(__file__).resolve().parents[1])
        else str(corpus),
        "totals": totals,
        "cases": rows,
    }
    table = (
        "| cases | imported right | refused with the true reason | wrong | fields checked |\n"
        "|---|---|---|---|---|\n"
        f"| {totals['cases']} | {totals['imported_right']} | {totals['refused_true_reason']} | "
        f"{totals['wrong']} | {totals['fields_checked']} |\n\n"
        "| case | expected | verdict | detail |\n|---|---|---|---|\n"
        + "\n".join(
            f"| {r['case']} | {r['expected']} | {r['verdict']} | "
            f"{r['detail'].replace('|', '/')[:160]} |"
            for r in rows
        )
    )
    name = "import_corpus" if corpus == CORPUS else f"import_{corpus.name}"
    save(name, data, table, args.results)
    if totals["wrong"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
