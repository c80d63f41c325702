"""``aihpc COMMAND`` registers only COMMAND's area: every command of the whole tree must be in
the map and reachable alone, with the same parameters as in the whole tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import typer.main

from aihpc.cli import COMMAND_AREAS, build_app


def _commands(tree: typer.Typer) -> dict:
    return typer.main.get_command(tree).commands


def test_every_command_is_mapped_to_the_area_that_registers_it() -> None:
    whole = _commands(build_app())
    assert set(whole) == set(COMMAND_AREAS)
    for name, command in whole.items():
        alone = _commands(build_app(name))
        same_area = {n for n, area in COMMAND_AREAS.items() if area == COMMAND_AREAS[name]}
        assert set(alone) == same_area, name
        assert [p.name for p in alone[name].params] == [p.name for p in command.params]


def test_a_command_process_does_not_load_the_other_areas() -> None:
    code = (
        "import sys; from aihpc.cli import main; sys.argv = ['aihpc', 'presets', '--json'];\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith('aihpc.cli.')), file=sys.stderr)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = out.stderr.strip().splitlines()[-1]
    assert "aihpc.cli.catalog" in loaded
    for other in ("aihpc.cli.train", "aihpc.cli.bench", "aihpc.cli.interop"):
        assert other not in loaded, loaded


def test_root_help_before_a_command_word_lists_every_command() -> None:
    """``aihpc -h search`` is the root's help (the root option comes first): every command."""
    code = "import sys; from aihpc.cli import main; sys.argv = ['aihpc', '-h', 'search']; main()"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    listed = {line.split()[1] for line in out.stdout.splitlines() if line.startswith("│ ")}
    assert set(COMMAND_AREAS) <= listed, set(COMMAND_AREAS) - listed


# Modules a `search --json` process has no use for (issue 21 prices the whole process: < 0.5 s of
# CPU, imports included). rich: the process prints one JSON document, so its consoles, tables and
# progress bar are made only where they print. The others are the trainer's, the benchmarks'
# and the dashboards' dependencies, and the other commands' own modules.
NOT_FOR_A_JSON_SEARCH = (
    "rich",
    "torch",
    "matplotlib",
    "prometheus_client",
    "aihpc.cli.train",
    "aihpc.cli.bench",
    "aihpc.cli.observe",
    "aihpc.cli.interop",
    "aihpc.runtime",
    "aihpc.observe",
    "aihpc.bench",
)
# typer >= 0.29 converts every option's value with pydantic (typer/_adapters.py); before, it
# needed no pydantic, and aihpc itself never imports it.
TYPER_NEEDS_PYDANTIC = any(r.startswith("pydantic") for r in metadata.requires("typer") or [])


def test_a_json_search_process_loads_only_what_it_uses(tmp_path: Path) -> None:
    """Issue 21 prices the whole `aihpc search` process; this guards what it loads, untimed."""
    spec = tmp_path / "search.toml"
    spec.write_text(
        '[model]\npreset = "llama3-8b"\n[cluster]\ngpu = "h100-sxm"\nnum_gpus = 64\n'
        "[parallel]\nglobal_batch_size = 128\n"
    )
    code = (
        "import sys; from aihpc.cli import main\n"
        f"sys.argv = ['aihpc', 'search', {str(spec)!r}, '--top', '3', '--json']\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "import json, os\n"
        "tasks = len(os.listdir('/proc/self/task')) if os.path.isdir('/proc/self/task') else 1\n"
        "print(json.dumps([sorted(sys.modules), tasks]), file=sys.stderr)"
    )
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert '"plans"' in out.stdout  # it searched
    loaded, threads = json.loads(out.stderr.strip().splitlines()[-1])
    # One OS thread (where Linux's /proc counts them): the planner calls no BLAS, so numpy's
    # OpenBLAS starts no thread per core at import (CPU that the process would pay for)
    assert threads == 1
    unwanted = NOT_FOR_A_JSON_SEARCH + (() if TYPER_NEEDS_PYDANTIC else ("pydantic",))
    heavy = [m for m in loaded if any(m == u or m.startswith(f"{u}.") for u in unwanted)]
    assert heavy == [], heavy
    assert "numpy" in loaded and "aihpc.perf.search.ranking" in loaded  # what the search does need
