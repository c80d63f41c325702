"""No input adds a line or a command to a script aihpc writes: every value that goes into the
sbatch script of ``aihpc launch`` (and Megatron-LM's launch script of ``aihpc export``) is
validated (``#SBATCH`` values, which Slurm reads unquoted) or shell-quoted (the rest). The
scripts are checked as bash reads them (``bash -n``) and run with stand-ins for Slurm's
commands: a hostile value reaches srun as the one argument it was, and runs nothing."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aihpc.cli import app
from aihpc.interop import export_megatron
from aihpc.interop.slurm import SlurmOptions, sbatch_script
from aihpc.runspec import SpecError, runspec_from_dict

ROOT = Path(__file__).resolve().parents[2]

# Values an attacker (or a careless paste) may put in a flag, a path or a run spec.
HOSTILE = [
    "x\nhostile",
    "x\rhostile",
    "x;hostile",
    "x$(hostile)",
    "x`hostile`",
    "x'hostile'",
    'x"hostile"',
    "x && hostile",
    "x\x00hostile",
]


def _spec(name: str = "llama3-8b") -> object:
    return runspec_from_dict(
        {
            "model": {"preset": "llama3-8b", "name": name},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 16},
            "parallel": {"tp": 8, "global_batch_size": 16},
        }
    )


def _stubs(tmp_path: Path) -> Path:
    """srun, scontrol and scancel stand-ins: srun records its arguments, one per line (NUL
    separated), scontrol names one node."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/bash\nprintf "%s\\0" "$@" > {tmp_path}/srun.args\n')
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho node1\n")
    (bin_dir / "scancel").write_text("#!/bin/bash\nexit 0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def _run_script(script: str, tmp_path: Path) -> list[str]:
    """Run the script as sbatch would (bash), Slurm's commands stood in for; srun's argv.
    A canary command ``hostile`` on PATH records if anything ever ran it."""
    bin_dir = _stubs(tmp_path)
    canary = tmp_path / "HOSTILE_RAN"
    (bin_dir / "hostile").write_text(f"#!/bin/bash\ntouch {canary}\n")
    (bin_dir / "hostile").chmod(0o755)
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_JOB_CPUS_PER_NODE": "2",
        "HOME": str(tmp_path),
        "PYTHONPATH": str(ROOT / "src"),  # the script's own helper (aihpc.runtime.slurm_job)
    }
    done = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not canary.exists(), "a value in the script ran a command"
    return (tmp_path / "srun.args").read_text().split("\0")[:-1]


def _first_words(script: str) -> list[str]:
    """Each line's first word (an assignment's name): a value that added or split a line
    changes this list."""
    return [re.split("[ =]", line, maxsplit=1)[0] for line in script.splitlines()]


def test_quoted_values_arrive_as_one_argument_and_run_nothing(tmp_path):
    """A run dir, a run-spec path and --env values with $(...), backticks, ; and quotes go
    into the script shell-quoted: the script has the lines of a plain one, bash accepts it, and
    srun receives each value as exactly the one argument it was."""
    plain_opts = SlurmOptions(
        Path("/r/run"), env=(("SITE_VALUE", "v"),), train_args=("--data", "v")
    )
    plain = sbatch_script(_spec(), Path("/p/run.toml"), plain_opts)
    for i, bad in enumerate(v for v in HOSTILE if v.isprintable()):
        run_dir = tmp_path / f"r{i}" / bad.replace(" ", "_").replace("'", "q").replace('"', "Q")
        spec_path = tmp_path / f"s{i}" / f"{bad}.toml"
        opts = SlurmOptions(run_dir, env=(("SITE_VALUE", bad),), train_args=("--data", bad))
        script = sbatch_script(_spec(), spec_path, opts)
        assert _first_words(script) == _first_words(plain)
        (tmp_path / f"t{i}").mkdir()
        argv = _run_script(script, tmp_path / f"t{i}")
        assert argv[argv.index("--run-dir") + 1] == str(run_dir.resolve())
        assert str(spec_path.resolve()) in argv and argv[-2:] == ["--data", bad]
        assert f"export SITE_VALUE={shlex.quote(bad)}" in script


@pytest.mark.parametrize("bad", HOSTILE)
@pytest.mark.parametrize(
    ("flag", "field"),
    [("--partition", "partition"), ("--time", "time_limit"), ("--account", "account")],
)
def test_sbatch_directives_refuse_anything_but_their_form(tmp_path, flag, field, bad):
    """#SBATCH values cannot be quoted: a value with a newline, a quote, ; $( or a backtick
    is refused, naming its flag."""
    good = {"partition": "gpu", "time_limit": "4:00:00", "account": "proj"}[field]
    with pytest.raises(SpecError) as err:
        sbatch_script(_spec(), Path("p.toml"), SlurmOptions(tmp_path, **{field: good + bad}))
    assert err.value.field == flag and "\n" not in str(err.value)


def test_slurm_time_forms(tmp_path):
    for ok in ("30", "30:00", "4:00:00", "2-0", "2-12:00", "2-12:00:00", "UNLIMITED"):
        script = sbatch_script(_spec(), Path("p.toml"), SlurmOptions(tmp_path, time_limit=ok))
        assert f"#SBATCH --time={ok}\n" in script
    for bad in ("4h", "1:2:3:4", "-1", "4:00:00 --uid=0", "\u0664:00:00"):  # an Arabic-Indic 4
        with pytest.raises(SpecError):
            sbatch_script(_spec(), Path("p.toml"), SlurmOptions(tmp_path, time_limit=bad))
    script = sbatch_script(
        _spec(), Path("p.toml"), SlurmOptions(tmp_path, partition="gpu,gpu-long", account="a.b")
    )
    assert "#SBATCH --partition=gpu,gpu-long\n" in script and "#SBATCH --account=a.b\n" in script


@pytest.mark.parametrize("bad", [v for v in HOSTILE if not v.isprintable()])
def test_control_characters_in_paths_and_env_are_refused(tmp_path, bad):
    """A newline can be quoted for bash but not for '#SBATCH --output' or a reader of the
    script: run dirs, run-spec paths and env values with control characters are refused."""
    cases = [
        ("--run-dir", Path("p.toml"), SlurmOptions(tmp_path / f"run{bad}")),
        ("RUNSPEC", Path(f"p{bad}.toml"), SlurmOptions(tmp_path)),
        ("--env", Path("p.toml"), SlurmOptions(tmp_path, env=(("SITE", bad),))),
        ("--env", Path("p.toml"), SlurmOptions(tmp_path, env=((f"A{bad}", "1"),))),
    ]
    for field, spec_path, opts in cases:
        with pytest.raises(SpecError) as err:
            sbatch_script(_spec(), spec_path, opts)
        assert err.value.field == field


def test_run_dir_with_spaces_is_refused_for_the_log_directive(tmp_path):
    with pytest.raises(SpecError) as err:
        sbatch_script(_spec(), Path("p.toml"), SlurmOptions(tmp_path / "a b --uid=0"))
    assert err.value.field == "--run-dir"
    script = sbatch_script(_spec(), Path("p.toml"), SlurmOptions(tmp_path / "100%"))
    assert f"#SBATCH --output={tmp_path.resolve()}/100%%/slurm-%j.log\n" in script


def test_a_hostile_model_name_stays_in_its_comment(tmp_path):
    """The run spec's model name is free text in the scripts' header comments."""
    spec = _spec("evil\nhostile\r\n#SBATCH --uid=0\u2028hostile")
    script = sbatch_script(spec, Path("p.toml"), SlurmOptions(tmp_path))
    plain = sbatch_script(_spec(), Path("p.toml"), SlurmOptions(tmp_path))
    assert _first_words(script) == _first_words(plain)
    assert sum(line.startswith("#SBATCH") for line in script.splitlines()) == sum(
        line.startswith("#SBATCH") for line in plain.splitlines()
    )
    _run_script(script, tmp_path)
    megatron, _ = export_megatron(spec, "evil\nhostile.toml")
    megatron_plain, _ = export_megatron(_spec(), "plain.toml")
    assert _first_words(megatron) == _first_words(megatron_plain)
    assert subprocess.run(["bash", "-n"], input=megatron, text=True).returncode == 0
    assert not any(line.strip() == "hostile" for line in megatron.splitlines())


@pytest.mark.parametrize(
    "args",
    [
        ["--partition", "gpu\nhostile"],
        ["--time", "1:00:00\nhostile"],
        ["--account", "a;hostile"],
        ["--env", "SITE=a\nhostile"],
    ],
)
def test_launch_refuses_with_exit_2_and_writes_nothing(tmp_path, args):
    run = tmp_path / "run"
    spec = ROOT / "examples" / "llama3-70b.toml"
    r = CliRunner().invoke(app, ["launch", str(spec), "--run-dir", str(run), *args])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and args[0] in lines[0], r.output
    assert not run.exists()
