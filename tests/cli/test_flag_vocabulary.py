"""One flag vocabulary across commands (issue 34): the file a command writes is -o / --output
everywhere, the old spellings still work for a release, and the messages and help name every
choice there is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from aihpc.cli import app, build_app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def _commands() -> dict[str, object]:
    out: dict[str, object] = {}

    def walk(cmd: object, path: str) -> None:
        subs = getattr(cmd, "commands", None)
        if subs:
            for name, sub in subs.items():
                walk(sub, f"{path} {name}".strip())
        else:
            out[path] = cmd

    walk(typer.main.get_command(build_app()), "")
    return out


def _options(cmd: object) -> list[tuple[list[str], bool]]:
    return [
        (list(p.opts) + list(p.secondary_opts), bool(getattr(p, "hidden", False)))
        for p in cmd.params  # type: ignore[attr-defined]
        if type(p).__name__.endswith("Option")
    ]


def test_every_output_file_flag_is_dash_o_and_dash_dash_output() -> None:
    writers = []
    for name, cmd in _commands().items():
        for opts, hidden in _options(cmd):
            if "--output" in opts:
                writers.append(name)
                assert "-o" in opts, f"aihpc {name}: --output without -o"
            if "-O" in opts:
                assert hidden and opts == ["-O"], f"aihpc {name}: -O is the old spelling"
            if "-o" in opts:
                assert "--output" in opts, f"aihpc {name}: -o means --output everywhere"
    expected = {"search", "calibrate", "dashboard", "import", "export", "launch"}
    assert expected | {"bench comm", "bench gemm", "bench moe"} <= set(writers)


def test_calibrate_still_reads_the_old_dash_capital_o(tmp_path: Path) -> None:
    log = ROOT / "tests" / "bench" / "data"
    source = next(p for p in sorted(log.iterdir()) if p.suffix == ".txt")
    out = tmp_path / "cal.toml"
    res = runner.invoke(app, ["calibrate", str(source), "-O", str(out), "--json"])
    assert res.exit_code == 0, res.output
    assert out.is_file() and json.loads(res.stdout)["output"] == str(out)
    assert "-O is now -o / --output" in res.stderr


def test_nccl_tests_dash_o_sum_is_refused_not_written_to_a_file(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    res = runner.invoke(app, ["bench", "comm", "-o", "sum"])
    assert res.exit_code == 2 and "nccl-tests' -o is --op here" in res.stderr
    assert not Path("sum").exists()


def test_the_strategy_error_names_compare() -> None:
    res = runner.invoke(
        app, ["goodput", str(ROOT / "examples" / "llama3-70b.toml"), "--strategy", "x"]
    )
    assert res.exit_code == 2 and "sync | async | in_memory | compare" in res.stderr


def test_train_help_names_expert_parallelism() -> None:
    out = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "200"}).stdout
    assert "EP" in out and "TP + SP" in out


def test_launch_writes_the_slurm_script_without_being_told_slurm(tmp_path: Path) -> None:
    spec = ROOT / "examples" / "tiny-train.toml"
    for extra in ([], ["--slurm"]):  # --slurm, required until 0.2, is still read
        run = tmp_path / f"run{len(extra)}"
        res = runner.invoke(app, ["launch", str(spec), *extra, "--run-dir", str(run), "--json"])
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["script"] == str(run / "job.sbatch")
        assert (run / "job.sbatch").read_text().startswith("#!/bin/bash")
    help_text = runner.invoke(app, ["launch", "--help"], env={"COLUMNS": "200"}).stdout
    assert "--slurm" not in help_text
