"""Every console example in README.md and docs/ runs as written and prints what it shows.

Rules for writers (volatile fields, abridged output, skips): docs/doc-examples.md; the matcher is
tests/docs/doc_examples.py. A failure prints the expected and the actual lines.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from doc_examples import (
    ROOT,
    Example,
    all_examples,
    doc_files,
    lines_match,
    normalize,
)

from aihpc.cli import app
from hang_bounds import hang_guard_s

EXAMPLES = all_examples()
# what a reader's checkout has at its top; the examples run in a scratch folder that links them,
# so the files they write (cal.toml, runs/) land there
LINKED = ("examples", "tests", "benchmarks", "docs", "src", "README.md", "pyproject.toml")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A scratch folder that looks like the checkout, and a PATH where `aihpc` and `python` are
    this interpreter (the examples are written for an installed aihpc)."""
    work = tmp_path_factory.mktemp("docs")
    for name in LINKED:
        (work / name).symlink_to(ROOT / name)
    bin_dir = tmp_path_factory.mktemp("bin")
    (bin_dir / "aihpc").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m aihpc "$@"\n')
    (bin_dir / "aihpc").chmod(0o755)
    for name in ("python", "python3"):
        (bin_dir / name).symlink_to(sys.executable)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "FORCE_COLOR")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return work, env


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.id for e in EXAMPLES])
def test_console_example(example: Example, workdir: tuple[Path, dict[str, str]]) -> None:
    if example.skip:
        pytest.skip(f"{example.id}: {example.skip}")
    assert example.commands, f"{example.id}: a console block without a `$ ` command line"
    work, env = workdir
    for cmd in example.commands:
        r = subprocess.run(
            ["bash", "-c", cmd.text],
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=hang_guard_s(example.timeout_s),  # stretched by the load now
        )
        actual = r.stdout.splitlines()
        if not lines_match(cmd.expected, actual, example.volatile, cmd.abridged):
            diff = difflib.unified_diff(
                [normalize(x) for x in cmd.expected if x.strip()],
                [normalize(x) for x in actual if x.strip()],
                "documented",
                "printed",
                lineterm="",
            )
            pytest.fail(
                f"{example.id}: `$ {cmd.text}` printed something else (volatile: "
                f"{example.volatile or 'none'}; abridged: {cmd.abridged}):\n" + "\n".join(diff)
            )
    assert r.returncode == example.exit_code, f"{example.id}: exit {r.returncode}\n{r.stdout}"


def _aihpc_invocations() -> list[tuple[str, list[str]]]:
    """Every `aihpc ...` command in a bash or console block of the docs, as argv."""
    out = []
    for path in doc_files():
        text = path.read_text(encoding="utf-8")
        in_block = False
        for n, raw in enumerate(text.replace("\\\n", " ").splitlines(), 1):
            if raw.strip().startswith("```"):
                in_block = raw.strip() in ("```bash", "```console", "```sh", "```shell")
                continue
            line = raw.strip().removeprefix("$ ")
            if not in_block or "aihpc " not in line or line.startswith("#"):
                continue
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            if "aihpc" in words:
                argv = words[words.index("aihpc") + 1 :]
                # the command ends at the shell's first operator or redirection (|, ;, &, >,
                # 2>&1, <file)
                ends = (i for i, w in enumerate(argv) if re.match(r"\d*[<>]|[|;&]", w))
                argv = argv[: next(ends, len(argv))]
                out.append((f"{path.relative_to(ROOT)}:{n}", argv))
    return out


def _rest(ctx: object) -> list[str]:
    """What a command group left for its subcommand (click renamed protected_args in 8.2)."""
    protected = getattr(ctx, "_protected_args", None) or getattr(ctx, "protected_args", [])
    return [*protected, *getattr(ctx, "args", [])]


def _parse_error(argv: list[str]) -> str | None:
    """Why click would refuse ``aihpc ARGV`` (unknown command or option, bad value), or None.
    Parsed down to the last subcommand, never invoked."""
    root = typer.main.get_command(app)
    try:
        with root.make_context("aihpc", list(argv)) as ctx:
            group, args, cmd_ctx = root, _rest(ctx), ctx
            while args and hasattr(group, "resolve_command"):
                name, cmd, args = group.resolve_command(cmd_ctx, args)
                cmd_ctx = cmd.make_context(name, args, parent=cmd_ctx)
                group, args = cmd, _rest(cmd_ctx)
    except Exception as err:  # click's UsageError and friends
        return str(err)
    return None


def test_every_documented_aihpc_command_parses() -> None:
    """Commands shown without output (```bash blocks) are not run, but each must name a real
    command and real options with valid values."""
    invocations = _aihpc_invocations()
    assert len(invocations) > 10  # the docs show many; finding none means the scan broke
    errors = [(where, argv, _parse_error(argv)) for where, argv in invocations]
    bad = [f"{where}: aihpc {' '.join(argv)}: {err}" for where, argv, err in errors if err]
    assert not bad, "\n".join(bad)
    assert _parse_error(["search", "x.toml", "--top", "two"]) is not None
    assert _parse_error(["estimate", "x.toml", "--no-such-flag"]) is not None
    assert _parse_error(["bench", "nonsense"]) is not None
    assert _parse_error(["bench", "comm", "-n", "3"]) is None


def test_matcher_rejects_what_differs() -> None:
    """The comparison is not vacuous: a changed number, a missing or an extra line fail it."""
    shown = ["tokens/s/GPU 930 · MFU 45.3%", "step 4.403", "done in 1.17 s"]
    vol = [r"\d+\.\d+ s"]
    assert lines_match(
        shown, ["tokens/s/GPU   930 · MFU 45.3%", "step 4.403", "done in 9.9 s"], vol, False
    )
    assert not lines_match(
        shown, ["tokens/s/GPU 931 · MFU 45.3%", "step 4.403", "done in 1 s"], vol, False
    )
    assert not lines_match(shown, ["tokens/s/GPU 930 · MFU 45.3%", "done in 1.17 s"], vol, False)
    assert not lines_match(shown, [*shown, "extra"], vol, False)
    assert lines_match(shown, ["a", shown[0], "b", shown[1], shown[2], "c"], vol, True)
    assert not lines_match(shown, [shown[1], shown[0], shown[2]], vol, True)
    assert lines_match(["x", "...", "y ... z"], ["x", "1", "2", "y 3 4 z"], [], False)
    assert lines_match(["━━━╇━━"], ["━━━━━━━╇━━━━"], [], False)


def test_bench_comm_example_accepts_every_time_the_table_can_print() -> None:
    """nccl-tests' columns keep as many decimals as fit (``float_str``): a time of 2466.66 us
    prints as such, 12345.7 and 123457 as those. On a loaded machine a 1 KiB all-reduce can take
    over 100 ms, so the README's volatile patterns must take every form; sizes, the #wrong
    counts and the rest of the row stay exact."""
    from aihpc.bench.collectives import float_str

    example = next(e for e in EXAMPLES if e.commands[0].text.startswith("aihpc bench comm"))
    rows = [x for x in example.commands[0].expected if normalize(x).startswith("1024 256 ")]
    shown = normalize(rows[0]).split(" ")  # size count type redop root, then 2 x 4 columns
    for time_us in (7.5, 2466.66, 12345.67, 123456.7, 1.23e7):
        printed = float_str(time_us, 7).strip()
        row = [*shown[:5], printed, *shown[6:9], printed, *shown[10:]]
        assert lines_match([rows[0]], [" ".join(row)], example.volatile, False), printed
    wrong = [*shown[:8], "1", *shown[9:]]  # an out-of-place #wrong of 1
    bigger = ["2048", *shown[1:]]
    for row in (wrong, bigger):
        assert not lines_match([rows[0]], [" ".join(row)], example.volatile, False), row
    footer = next(x for x in example.commands[0].expected if "Avg bus bandwidth" in x)
    for avg in (0.213633, 0.0213633, 2.13633e-05, 1.0):
        assert lines_match([footer], [f"# Avg bus bandwidth : {avg:g}"], example.volatile, False)
