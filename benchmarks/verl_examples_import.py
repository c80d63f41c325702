"""How `aihpc import verl` does on verl's own example scripts: every shell script under a verl
checkout's examples/ that runs `main_ppo` (or its DAPO recipe's `main_dapo`), imported and
priced end to end (the run spec checked, then `estimate_rl`), counted as imported or refused,
each refusal with its one line. A traceback counts as a failure of aihpc, not of the script.

    git clone https://github.com/volcengine/verl verl-checkout
    python benchmarks/verl_examples_import.py verl-checkout --results benchmarks/results
    # the DAPO recipe's scripts, at the last commit that held them (2026-01-06):
    git -C verl-checkout checkout 246cac4
    python benchmarks/verl_examples_import.py verl-checkout --under recipe/dapo \
        --name verl_dapo_recipe_import --results benchmarks/results

A script whose model names no preset (most name Qwen2 / Qwen2.5 checkpoints, which aihpc has no
preset for) is priced with a stand-in of its kind, llama3-8b, or qwen3-30b-a3b where it sets
expert parallelism; the table says which. --response-len (default 100) stands in for the mean
response, which no verl config gives.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import traceback
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import add_results_arg, machine, save

from aihpc.interop.verl import import_verl
from aihpc.perf.rl import estimate_rl
from aihpc.runspec import SpecError

DENSE, MOE = "llama3-8b", "qwen3-30b-a3b"  # the stand-ins


ENTRIES = ("main_ppo", "main_dapo")  # verl's trainer, its DAPO recipe's


def _scripts(verl: Path, under: str) -> list[Path]:
    return sorted(
        p
        for p in (verl / under).rglob("*.sh")
        if any(e in p.read_text(errors="replace") for e in ENTRIES)
    )


def _import(text: str, response_len: int):
    """The script imported with its own model where that names a preset; else with a stand-in
    of its kind (a MoE preset where it sets expert parallelism, a dense one otherwise)."""
    try:
        return import_verl(text, response_len=response_len), "own"
    except SpecError as err:
        if err.field != "--model":
            raise
    dense = import_verl(text, model=DENSE, response_len=response_len)
    moe = int(dense.tables["parallel"].get("ep", 1)) > 1
    if not moe:
        return dense, DENSE
    return import_verl(text, model=MOE, response_len=response_len), MOE


def _one(path: Path, response_len: int) -> tuple[str, str, str]:
    """("imported" | "refused" | "traceback", the model priced, the refusal's line or error)."""
    model = ""
    try:
        imported, model = _import(path.read_text(), response_len)
        estimate_rl(imported.spec())
    except SpecError as err:
        return "refused", model, str(err).splitlines()[0]
    except Exception:  # a bug of aihpc's: counted and shown, never hidden
        return "traceback", model, traceback.format_exc().strip().splitlines()[-1]
    return "imported", model, ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("verl", type=Path, help="a verl checkout")
    ap.add_argument("--response-len", type=int, default=100)
    ap.add_argument("--under", default="examples", help="the checkout's folder of scripts")
    ap.add_argument("--name", default="verl_examples_import", help="the results' file name")
    add_results_arg(ap)
    args = ap.parse_args()
    scripts = _scripts(args.verl, args.under)
    if not scripts:
        sys.exit(f"error: {args.verl}/{args.under} has no script that runs main_ppo or main_dapo")
    rev = subprocess.run(
        ["git", "-C", str(args.verl), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    rows = []
    for i, path in enumerate(scripts, 1):
        outcome, model, why = _one(path, args.response_len)
        script = str(path.relative_to(args.verl))
        rows.append({"script": script, "outcome": outcome, "model": model, "why": why})
        if i % 25 == 0 or i == len(scripts):
            print(f"{i}/{len(scripts)} scripts", file=sys.stderr, flush=True)
    counts = Counter(r["outcome"] for r in rows)
    own = sum(r["outcome"] == "imported" and r["model"] == "own" for r in rows)
    lines = [
        f"verl at {rev or 'an unknown revision'}: {len(rows)} scripts under {args.under} that run "
        f"main_ppo or main_dapo, --response-len {args.response_len}",
        "",
        f"imported and priced: {counts['imported']} ({own} with their own model's preset, the "
        f"rest with a stand-in); refused in one line: {counts['refused']}; "
        f"tracebacks: {counts['traceback']}",
        "",
        "| script | outcome | model | line |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['script']} | {r['outcome']} | {r['model']} | {r['why']} |"
        for r in rows
        if r["outcome"] != "imported"
    ]
    data = {"verl_revision": rev, "counts": dict(counts), "rows": rows, "machine": machine()}
    save(args.name, data, "\n".join(lines), args.results)


if __name__ == "__main__":
    main()
