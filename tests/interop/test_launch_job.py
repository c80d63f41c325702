"""What the sbatch script of `aihpc launch` hands the job, checked without Slurm: bash runs the
script with stand-ins for srun, scontrol and scancel. Every `aihpc train` option is a launch
option and reaches the ranks; the node's task gets the node's CPUs; the rendezvous port is
chosen free when the job starts; at the time limit the job requeues only after a newer
checkpoint verified and under the cap; a job's end is reported as Slurm has it."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from aihpc.cli import build_app
from aihpc.interop.slurm import SlurmOptions, sbatch_script
from aihpc.interop.slurm_jobs import JobState, final_report
from aihpc.runspec import SpecError, runspec_from_dict
from aihpc.runtime.slurm_job import FINISHED, REQUEUE, STOP, rdzv_port, requeue_decision

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-train.toml"
runner = CliRunner()


def _spec(num_gpus: int = 16, gpus_per_node: int = 8) -> object:
    return runspec_from_dict(
        {
            "model": {"preset": "llama3-8b"},
            "cluster": {"gpu": "h100-sxm", "num_gpus": num_gpus, "gpus_per_node": gpus_per_node},
            "parallel": {"tp": min(8, num_gpus), "global_batch_size": 16},
        }
    )


def _stubs(d: Path, srun_body: str = "") -> Path:
    """srun records its arguments (NUL separated), OMP_NUM_THREADS and MASTER_ADDR:PORT, then runs
    ``srun_body``; scontrol names one node and records a requeue; scancel does nothing."""
    bin_dir = d / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "srun").write_text(
        f'#!/bin/bash\nprintf "%s\\0" "$@" > {d}/srun.args\n'
        f'echo "$OMP_NUM_THREADS" > {d}/omp\n'
        f'echo "${{MASTER_ADDR:-}}:${{MASTER_PORT:-}}" > {d}/master\n{srun_body}\n'
    )
    (bin_dir / "scontrol").write_text(
        f'#!/bin/bash\nif [ "$1" = requeue ]; then echo "$2" >> {d}/requeued; else echo node1; fi\n'
    )
    (bin_dir / "scancel").write_text("#!/bin/bash\nexit 0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def _run(script: str, d: Path, srun_body: str = "", **env: str) -> subprocess.CompletedProcess:
    d.mkdir(parents=True, exist_ok=True)
    bin_dir = _stubs(d, srun_body)
    path = d / "job.sbatch"
    path.write_text(script)
    full = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT / "src"),
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_JOB_CPUS_PER_NODE": "2",
        "HOME": str(d),
        **env,
    }
    return subprocess.run(
        ["bash", str(path)], env=full, capture_output=True, text=True, timeout=120
    )


def _argv(d: Path) -> list[str]:
    return (d / "srun.args").read_text().split("\0")[:-1]


def _options(command: object) -> dict[str, object]:
    return {p.name: p for p in command.params}


def test_every_train_option_is_a_launch_option() -> None:
    """Taken from train's own declaration: an option train gains is launch's too."""
    train = _options(typer.main.get_command(build_app("train")).commands["train"])
    launch = _options(typer.main.get_command(build_app("launch")).commands["launch"])
    decided = {"runspec", "run_dir", "nproc_per_node", "as_json"}  # the launch's own
    for name, param in train.items():
        if name in decided:
            continue
        assert name in launch, f"aihpc train {param.opts} is not an aihpc launch option"
        assert launch[name].opts == param.opts and launch[name].multiple == param.multiple
        assert launch[name].type.name == param.type.name and launch[name].default == param.default
    wanted = {"data", "metrics_port", "metrics_host", "metrics_textfile", "hang_timeout"}
    assert wanted | {"max_restarts", "startup_timeout", "inject"} <= set(launch)


def test_given_train_options_reach_every_rank(tmp_path: Path) -> None:
    data = tmp_path / "corpus.txt"
    data.write_text("some text\n")
    run = tmp_path / "run"
    args = ["launch", str(TINY), "--run-dir", str(run), "--no-gpus", "--data", str(data),
            "--metrics-port", "9400", "--metrics-host", "0.0.0.0", "--metrics-textfile",
            str(tmp_path / "prom"), "--hang-timeout", "60", "--startup-timeout", "90",
            "--max-restarts", "2", "--inject", "kill:step=3"]  # fmt: skip
    res = runner.invoke(build_app("launch"), args)
    assert res.exit_code == 0, res.output
    done = _run((run / "job.sbatch").read_text(), tmp_path / "job")
    assert done.returncode == 0, done.stdout + done.stderr
    argv = _argv(tmp_path / "job")
    train = argv[argv.index("train") :]

    def value(flag: str) -> str:
        return train[train.index(flag) + 1]

    assert value("--data") == str(data) and value("--metrics-port") == "9400"
    assert value("--metrics-host") == "0.0.0.0"
    assert value("--metrics-textfile") == str(tmp_path / "prom")
    assert float(value("--hang-timeout")) == 60 and float(value("--startup-timeout")) == 90
    assert value("--inject") == "kill:step=3"
    # torchrun restarts the node's worker group; train's own --max-restarts is for its agent
    assert "--max-restarts=2" in argv[: argv.index("train")] and "--max-restarts" not in train


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        (["--data", "/no/such/file.txt"], "--data"),
        (["--hang-timeout", "0"], "--hang-timeout"),
        (["--metrics-port", "70000"], "--metrics-port"),
        (["--max-restarts", "-1"], "--max-restarts"),
        (["--inject", "kill:step=999"], "--inject"),
        (["--cpus-per-task", "0"], "--cpus-per-task"),
        (["--max-requeues", "-1"], "--max-requeues"),
        (["--rdzv-port", "80"], "--rdzv-port"),
    ],
)
def test_bad_values_are_refused_before_any_script(tmp_path: Path, extra, field) -> None:
    run = tmp_path / "run"
    res = runner.invoke(build_app("launch"), ["launch", str(TINY), "--run-dir", str(run), *extra])
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith(f"error: {field} = ") and len(res.stderr.splitlines()) == 1
    assert not (run / "job.sbatch").exists()


def test_whole_multi_gpu_nodes_are_taken_exclusive_with_every_cpu(tmp_path: Path) -> None:
    """Two nodes of 8 GPUs: the job takes them whole, and the node's one task gets the CPUs of
    the smallest node (Slurm gives a task one CPU unless told), 1/8 of them per rank."""
    script = sbatch_script(_spec(), Path("p.toml"), SlurmOptions(tmp_path / "r"))
    assert "#SBATCH --exclusive\n" in script and "#SBATCH --cpus-per-task" not in script
    done = _run(script, tmp_path / "job", SLURM_JOB_CPUS_PER_NODE="72(x1),36")
    assert done.returncode == 0, done.stderr
    assert "--cpus-per-task=36" in _argv(tmp_path / "job")
    assert (tmp_path / "job" / "omp").read_text().strip() == str(36 // 8)


def test_a_job_on_part_of_a_node_asks_for_its_share(tmp_path: Path) -> None:
    spec = _spec(num_gpus=2, gpus_per_node=8)
    script = sbatch_script(spec, Path("p.toml"), SlurmOptions(tmp_path, node_cpus=64))
    assert "#SBATCH --cpus-per-task=16\n" in script and "--exclusive" not in script
    with pytest.raises(SpecError) as err:  # sinfo gave nothing: the flag is named
        sbatch_script(spec, Path("p.toml"), SlurmOptions(tmp_path))
    assert err.value.field == "--cpus-per-task"
    over = SlurmOptions(tmp_path, cpus_per_task=10, exclusive=False)
    script = sbatch_script(_spec(), Path("p.toml"), over)  # flags override the whole-node rule
    assert "#SBATCH --cpus-per-task=10\n" in script and "--exclusive" not in script
    _run(script, tmp_path / "job")
    assert "--cpus-per-task=10" in _argv(tmp_path / "job")


def _endpoint(d: Path) -> str:
    return next(a for a in _argv(d) if a.startswith("--rdzv-endpoint="))


def test_rendezvous_port_is_per_job_and_free(tmp_path: Path) -> None:
    script = sbatch_script(_spec(), Path("p.toml"), SlurmOptions(tmp_path / "r"))
    assert "29500" not in script
    ports = set()
    for job in ("7", "8"):
        _run(script, tmp_path / job, SLURM_JOB_ID=job)
        ports.add(_endpoint(tmp_path / job))
    assert len(ports) == 2  # two jobs on one node do not meet on one port
    with socket.socket() as busy:  # the port job 9 picks is taken: the next free one
        busy.bind(("", rdzv_port(9)))
        busy.listen()
        taken = busy.getsockname()[1]
        _run(script, tmp_path / "9", SLURM_JOB_ID="9")
        assert _endpoint(tmp_path / "9") != f"--rdzv-endpoint=node1:{taken}"
    fixed = sbatch_script(_spec(), Path("p.toml"), SlurmOptions(tmp_path / "r", rdzv_port=29555))
    _run(fixed, tmp_path / "fixed")
    assert _endpoint(tmp_path / "fixed") == "--rdzv-endpoint=node1:29555"


def _checkpoint(run_dir: Path, step: int, corrupt: bool = False) -> Path:
    """A committed checkpoint folder as the manifest module reads one."""
    path = run_dir / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    data = os.urandom(64)
    (path / "model.bin").write_bytes(data)
    meta = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "MANIFEST.json").write_text(json.dumps({"files": {"model.bin": meta}}))
    if corrupt:
        (path / "model.bin").write_bytes(os.urandom(64))
    return path


def test_requeue_only_after_a_newer_verified_checkpoint_and_under_the_cap(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    code, line = requeue_decision(run, "7", 0, 3, -1, 0.0)
    assert code == STOP and "no checkpoint newer than the start" in line
    assert "requeueing job" not in line
    _checkpoint(run, 5)
    code, line = requeue_decision(run, "7", 0, 3, 5, 0.0)  # the attempt began at step 5
    assert code == STOP and "no checkpoint newer than step 5" in line
    _checkpoint(run, 8)
    code, line = requeue_decision(run, "7", 0, 3, 5, 0.0)
    assert code == REQUEUE
    assert line == (
        "aihpc: checkpoint step 8 committed (verified); requeueing job 7 (requeue 1 of at most 3)"
    )
    code, line = requeue_decision(run, "7", 3, 3, 5, 0.0)
    assert code == STOP and "the cap (--max-requeues 3)" in line and "resumes from step 8" in line
    _checkpoint(run, 9, corrupt=True)
    code, line = requeue_decision(run, "7", 0, 3, 5, 0.0)
    assert code == STOP and "step 9 does not verify" in line
    (run / "events.jsonl").write_text(json.dumps({"event": "done", "step": 9, "time_unix": 50.0}))
    assert requeue_decision(run, "7", 0, 3, 5, 10.0)[0] == FINISHED
    assert requeue_decision(run, "7", 0, 3, 5, 60.0)[0] == STOP  # an earlier attempt's


def test_time_limit_before_any_checkpoint_stops_without_requeue(tmp_path: Path) -> None:
    """The time limit's warning reaches the script while the ranks run (srun's stand-in sends
    it, then ends as ranks stopped before a checkpoint do): nothing was saved, so the job stops
    with one line, exit non-zero, and is not requeued."""
    run = tmp_path / "run"
    script = sbatch_script(_spec(), Path("p.toml"), SlurmOptions(run))
    done = _run(script, tmp_path / "job", srun_body="kill -USR1 $PPID; sleep 1; exit 143")
    assert done.returncode == 143, done.stdout + done.stderr
    assert not (tmp_path / "job" / "requeued").exists()
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("aihpc: ")]
    assert lines[-1].startswith("aihpc: no checkpoint newer than the start (none before) was")
    assert "requeueing" not in done.stdout and "checkpoint taken" not in done.stdout


def test_time_limit_after_a_new_checkpoint_requeues_up_to_the_cap(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _checkpoint(run, 5)
    src = _checkpoint(tmp_path / "new", 10)
    body = f"mkdir -p {run}/checkpoints; cp -r {src} {run}/checkpoints/; kill -USR1 $PPID; sleep 1"
    script = sbatch_script(_spec(), Path("p.toml"), SlurmOptions(run, max_requeues=2))
    done = _run(script, tmp_path / "a", srun_body=body)
    assert (tmp_path / "a" / "requeued").read_text().split() == ["7"], done.stdout
    assert "requeueing job 7 (requeue 1 of at most 2)" in done.stdout
    # the same on the job's third attempt (requeued twice, the cap): it stops, exit 1
    for p in (run / "checkpoints" / "step_00000010").iterdir():
        p.unlink()
    (run / "checkpoints" / "step_00000010").rmdir()
    done = _run(script, tmp_path / "b", srun_body=body, SLURM_RESTART_COUNT="2")
    assert done.returncode == 1 and not (tmp_path / "b" / "requeued").exists()
    assert (
        "requeued 2 time(s), the cap (--max-requeues 2): it ends here, not requeued" in done.stdout
    )
    # requeued more often than the cap (by Slurm): the attempt does not train at all
    done = _run(script, tmp_path / "c", SLURM_RESTART_COUNT="3")
    assert done.returncode == 1 and not (tmp_path / "c" / "srun.args").exists()
    assert "requeued 3 times, over --max-requeues 2: not training" in done.stderr


def _state(state: str, code: int = 0, sig: int = 0, restarts: int = 0, ran: bool = True):
    return JobState(state, "None", code, sig, restarts, "n1" if ran else "", ran=ran)


def test_a_job_ends_as_slurm_has_it() -> None:
    assert final_report("5", _state("COMPLETED"), True) == (0, "job 5 COMPLETED, exit code 0")
    code, line = final_report("5", _state("CANCELLED", ran=False), False)
    assert code == 1 and "cancelled while pending: it never ran" in line
    code, line = final_report("5", _state("CANCELLED", sig=15), True)
    assert code == 143 and "cancelled while running" in line
    code, line = final_report("5", _state("FAILED", code=1, restarts=2), True)
    assert (code, line) == (
        1,
        "job 5 FAILED, requeues 2: the batch script exited non-zero; exit code 1",
    )
    code, line = final_report("5", _state("TIMEOUT"), True)
    assert code == 1 and "time limit" in line
    assert JobState("PREEMPTED", "", 0, 0, 0, "", requeue=False).final
    assert not JobState("PREEMPTED", "", 0, 0, 0, "").final  # Slurm requeues it


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_framework_jobs_run_the_export_under_srun_and_torchrun(tmp_path: Path) -> None:
    """`--framework megatron|torchtitan`: the run directory holds the plan's export and the
    script runs it as the frameworks' own Slurm examples do (one srun task per node running
    torchrun, c10d on the first node at a per-job port), with the same allocation and CPUs."""
    spec = tmp_path / "llama3-8b.toml"
    spec.write_text(
        '[model]\npreset = "llama3-8b"\n[cluster]\ngpu = "h100-sxm"\nnum_gpus = 16\n'
        "[parallel]\ntp = 2\nzero_stage = 3\nglobal_batch_size = 64\n"
    )
    app = build_app("launch")
    for framework, config in (("megatron", "megatron.sh"), ("torchtitan", "torchtitan.toml")):
        run = tmp_path / framework
        res = runner.invoke(app, ["launch", str(spec), "--run-dir", str(run), "--framework",
                                  framework])  # fmt: skip
        assert res.exit_code == 0, res.output
        script = (run / "job.sbatch").read_text()
        assert "#SBATCH --nodes=2\n" in script and "#SBATCH --exclusive\n" in script
        assert "--requeue" not in script  # the framework's checkpoints are not aihpc's to verify
        assert (run / config).is_file()
        d = tmp_path / f"{framework}-job"
        done = _run(script, d, SLURM_JOB_ID="12345", SLURM_SUBMIT_DIR=str(tmp_path))
        assert done.returncode == 0, done.stdout + done.stderr
        argv = _argv(d)
        assert argv[:3] == ["--kill-on-bad-exit=1", "--ntasks-per-node=1", "--cpus-per-task=2"]
        port = 20000 + 12345 % 12000
        if framework == "megatron":
            assert argv[3:] == ["bash", str(run / config)]
            # the exported script's torchrun reads its rendezvous from these
            assert (d / "master").read_text().strip() == f"node1:{port}"
        else:
            assert f"--rdzv-endpoint=node1:{port}" in argv and "torchtitan.train" in argv
            assert argv[argv.index("--job.config_file") + 1] == str(run / config)
            assert argv[argv.index("--job.dump_folder") + 1] == str(run)
    res = runner.invoke(app, ["launch", str(spec), "--run-dir", str(tmp_path / "x"),
                              "--framework", "megatron", "--hang-timeout", "10"])  # fmt: skip
    assert res.exit_code == 2 and res.stderr.startswith("error: --hang-timeout = 10.0: an aihpc")
    res = runner.invoke(app, ["launch", str(spec), "--run-dir", str(tmp_path / "x"),
                              "--framework", "deepspeed"])  # fmt: skip
    assert res.exit_code == 2 and "--framework = 'deepspeed'" in res.stderr
