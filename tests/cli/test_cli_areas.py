"""``aihpc COMMAND`` registers only COMMAND's area: every command of the whole tree must be in
the map and reachable alone, with the same parameters as in the whole tree."""

from __future__ import annotations

import subprocess
import sys

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
