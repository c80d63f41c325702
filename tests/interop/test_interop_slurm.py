"""`aihpc launch` against a real Slurm (slurmctld + slurmd from Debian's slurm-wlm,
started on this machine by tests/interop/slurm_cluster.py): a 2-rank job trains the tiny model;
`scontrol requeue` of a job `aihpc launch --submit` follows makes the ranks checkpoint, the
preempted attempt ends its log with one line (no traceback), the requeued job resumes from that
checkpoint to the same final state as the uninterrupted job, and its summary counts the requeue
as the follower does; the time limit's warning (SIGUSR1 to the batch script) does the same
through the script's own requeue; `scancel` leaves every checkpoint intact."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import slurm_cluster

from aihpc.resilience.manifest import committed_checkpoints, verify_checkpoint
from hang_bounds import hang_guard_s

ROOT = Path(__file__).resolve().parents[2]
STEPS = 24

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    why = slurm_cluster.available()
    if why:
        pytest.skip(why)
    d = tmp_path_factory.mktemp("slurm")
    env = slurm_cluster.start(d)
    yield {
        **os.environ,
        **env,
        "PYTHONPATH": str(ROOT / "src"),
        "OMP_NUM_THREADS": "1",
    }
    subprocess.run(["scancel", "--user=root"], env={**os.environ, **env}, timeout=30)
    slurm_cluster.stop(d)


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> Path:
    text = (ROOT / "examples" / "tiny-train.toml").read_text()
    for old, new in [
        ("train_steps = 40", f"train_steps = {STEPS}"),
        ("micro_batch_size = 4", "micro_batch_size = 2"),
        ("global_batch_size = 16", "global_batch_size = 4"),
        ("interval_steps = 10", "interval_steps = 5"),
        ("keep_last = 2", "keep_last = 10"),
    ]:
        text = text.replace(old, new)
    path = tmp_path_factory.mktemp("spec") / "tiny.toml"
    path.write_text(text)
    return path


def _aihpc(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "aihpc", *args], env=env, capture_output=True, text=True,
        timeout=hang_guard_s(timeout),
    )  # fmt: skip


def _script(env: dict[str, str], spec: Path, run_dir: Path, port: int) -> Path:
    done = _aihpc(env, "launch", str(spec), "--slurm", "--run-dir", str(run_dir), "--no-gpus",
                  "--rdzv-port", str(port))  # fmt: skip
    assert done.returncode == 0, done.stderr
    return run_dir / "job.sbatch"


def _scontrol(env: dict[str, str], *args: str) -> str:
    return subprocess.run(
        ["scontrol", *args], env=env, capture_output=True, text=True, timeout=30, check=True
    ).stdout


def _state(env: dict[str, str], job: str) -> dict[str, str]:
    out = _scontrol(env, "show", "job", "-o", job)
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def _wait(env: dict[str, str], job: str, states: set[str], timeout: float = 240) -> dict:
    deadline = time.monotonic() + hang_guard_s(timeout)
    while time.monotonic() < deadline:
        s = _state(env, job)
        if s["JobState"] in states:
            return s
        time.sleep(0.5)
    raise AssertionError(f"job {job} not in {states} after {timeout}s: {s['JobState']}")


def _steps(run_dir: Path) -> int:
    try:
        return len((run_dir / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def _sbatch(env: dict[str, str], script: Path) -> str:
    out = subprocess.run(["sbatch", "--parsable", str(script)], env=env, capture_output=True,
                         text=True, timeout=30, check=True).stdout  # fmt: skip
    return out.strip().split(";")[0]


def _running_past(env: dict[str, str], job: str, run_dir: Path, steps: int) -> None:
    deadline = time.monotonic() + hang_guard_s(180)
    while _steps(run_dir) < steps and time.monotonic() < deadline:
        assert _state(env, job)["JobState"] in ("PENDING", "RUNNING"), _state(env, job)
        time.sleep(0.2)


@pytest.fixture(scope="module")
def straight(slurm: dict[str, str], spec: Path, tmp_path_factory) -> dict:
    """The uninterrupted job, submitted and followed by `aihpc launch --submit`."""
    run_dir = tmp_path_factory.mktemp("straight")
    prom = run_dir.parent / f"{run_dir.name}.prom"
    # no --rdzv-port: the job picks a free one; train's options pass through to the ranks
    done = _aihpc(slurm, "launch", str(spec), "--slurm", "--run-dir", str(run_dir), "--no-gpus",
                  "--submit", "--metrics-textfile", str(prom), "--hang-timeout", "120")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    job = re.search(r"submitted job (\d+)", done.stderr).group(1)
    return {
        "stderr": done.stderr,
        "summary": json.loads((run_dir / "summary.json").read_text()),
        "state": _state(slurm, job),
        "prom": prom,
        "script": (run_dir / "job.sbatch").read_text(),
    }


def test_two_rank_job_trains(straight: dict) -> None:
    summary = straight["summary"]
    assert summary["world_size"] == 2 and summary["final_step"] == STEPS
    lines = straight["stderr"].splitlines()
    assert any(ln.startswith("submitted job ") for ln in lines)
    assert any("RUNNING on localhost" in ln for ln in lines)  # followed: state
    assert any(f"step {STEPS}/{STEPS}" in ln for ln in lines)  # followed: the log's tail
    assert lines[-1].endswith("COMPLETED, exit code 0")


def test_job_has_the_node_and_train_options_reach_the_ranks(straight: dict) -> None:
    """The job fills its node (2 ranks on a node of 2 GPUs), so it has it whole: every CPU
    (Slurm gave such a job one), not shared; --metrics-textfile, an `aihpc train` option, reached
    the ranks, which wrote node-exporter's file there; the rendezvous port was not fixed."""
    state, script = straight["state"], straight["script"]
    assert int(state["NumCPUs"]) == os.cpu_count() and state["OverSubscribe"] == "NO"
    assert "#SBATCH --exclusive" in script and "29500" not in script
    assert list(straight["prom"].glob("*.prom"))


def _job_id(out: Path, timeout: float = 60) -> str:
    deadline = time.monotonic() + hang_guard_s(timeout)
    while time.monotonic() < deadline:
        found = re.search(r"submitted job (\d+)", out.read_text())
        if found:
            return found.group(1)
        time.sleep(0.2)
    raise AssertionError(f"no job submitted: {out.read_text()[-2000:]}")


def _resume(env: dict[str, str], job: str) -> None:
    """Wait for the requeued job, and start it now: Slurm holds a requeued job back for two
    minutes (its BeginTime)."""
    _wait(env, job, {"PENDING"})
    _scontrol(env, "update", f"JobId={job}", "StartTime=now")


def _preempted_step(run_dir: Path) -> int:
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    stopped = {e["step"] for e in events if e["event"] == "preempted"}
    assert len(stopped) == 1  # every rank stopped at the same step
    assert all(e["signal"] == 15 for e in events if e["event"] == "preempted")  # SIGTERM
    return stopped.pop()


@pytest.fixture(scope="module")
def requeued(slurm: dict[str, str], spec: Path, tmp_path_factory) -> dict:
    """A job that `aihpc launch --submit` follows, requeued by `scontrol requeue` mid-run (as
    preemption in requeue mode does)."""
    run_dir = tmp_path_factory.mktemp("requeued")
    out = run_dir.parent / f"{run_dir.name}.follow.txt"
    with open(out, "w") as f:
        follower = subprocess.Popen(
            [sys.executable, "-m", "aihpc", "launch", str(spec), "--slurm", "--run-dir",
             str(run_dir), "--no-gpus", "--submit"],
            env=slurm, stdout=f, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    try:
        job = _job_id(out)
        _running_past(slurm, job, run_dir, 7)
        _scontrol(slurm, "requeue", job)
        _resume(slurm, job)
        code = follower.wait(timeout=hang_guard_s(240))
    finally:
        follower.kill()
    follow = out.read_text()
    assert code == 0, follow[-3000:]
    return {
        "job": job,
        "run_dir": run_dir,
        "follow": follow.splitlines(),
        "log": (run_dir / f"slurm-{job}.log").read_text(),
        "summary": json.loads((run_dir / "summary.json").read_text()),
        "state": _state(slurm, job),
    }


def test_requeue_resumes_to_the_same_state(requeued: dict, straight: dict) -> None:
    assert requeued["state"]["JobState"] == "COMPLETED" and requeued["state"]["Restarts"] == "1"
    step = _preempted_step(requeued["run_dir"])
    summary = requeued["summary"]
    assert summary["resumed_from_step"] == step >= 7
    assert summary["state_sha256"] == straight["summary"]["state_sha256"]


def test_preempted_attempt_ends_in_one_line(requeued: dict) -> None:
    """The attempt Slurm requeued stopped as designed: its log holds no traceback and its last
    line of aihpc's says where the ranks stopped and what the requeued job resumes from."""
    job, log = requeued["job"], requeued["log"]
    assert "Traceback" not in log
    first, sep, _ = log.partition(f"aihpc: job {job} (requeues 1) on ")
    assert sep, log[-3000:]
    step = _preempted_step(requeued["run_dir"])
    ours = [ln for ln in first.splitlines() if ln.startswith("aihpc: ")]
    assert ours[-1] == (
        f"aihpc: stopped by SIGTERM after step {step} with its checkpoint committed; "
        f"a requeued or resubmitted job resumes from step {step}"
    ), first[-3000:]
    assert "srun: error" not in first  # the node's task ended as designed, exit 0


def test_summary_and_follower_count_the_requeue_alike(requeued: dict) -> None:
    """Slurm's count of requeues is the summary's `requeues`, in summary.json, in the line the
    job prints and in the follower's lines; `restarts` (torchrun's restarts of the worker group
    within the launch that finished) stays 0."""
    job, summary, follow = requeued["job"], requeued["summary"], requeued["follow"]
    assert summary["requeues"] == 1 and summary["restarts"] == 0
    assert summary["slurm_job_id"] == job
    trained = [ln for ln in follow if ln.startswith("  | trained ")]
    assert len(trained) == 1 and ", restarts 0, requeues 1, resumed from step" in trained[0]
    assert f"job {job}: RUNNING on localhost, requeues 1" in follow
    assert follow[-1] == f"job {job} COMPLETED, requeues 1, exit code 0"
    assert not [ln for ln in follow if re.search(r"\brestart \d", ln)]  # one word, one count


def test_time_limit_warning_checkpoints_and_requeues(
    slurm: dict[str, str], spec: Path, straight: dict, tmp_path: Path
) -> None:
    """`--signal=B:USR1@LEAD` warns the batch script before the time limit (sent here by
    `scancel --batch --signal=USR1`): the ranks save the step in flight, the script requeues the
    job, and the requeued job resumes from that step to the uninterrupted job's state."""
    run_dir = tmp_path / "time-limit"
    job = _sbatch(slurm, _script(slurm, spec, run_dir, slurm_cluster.free_port()))
    _running_past(slurm, job, run_dir, 7)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm, check=True, timeout=30)
    _resume(slurm, job)
    final = _wait(slurm, job, {"COMPLETED", "FAILED", "CANCELLED"})
    assert final["JobState"] == "COMPLETED" and final["Restarts"] == "1"
    step = _preempted_step(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_step"] == step >= 7 and summary["requeues"] == 1
    assert summary["state_sha256"] == straight["summary"]["state_sha256"]
    log = (run_dir / f"slurm-{job}.log").read_text()
    assert "Traceback" not in log
    # said once the checkpoint was found committed and verified, not before
    said = f"aihpc: checkpoint step {step} committed (verified); requeueing job {job} (requeue 1"
    assert said in log and log.index(said) > log.index(f"after step {step} with its checkpoint")


def test_cancel_leaves_checkpoints_intact(
    slurm: dict[str, str], spec: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "cancelled"
    job = _sbatch(slurm, _script(slurm, spec, run_dir, slurm_cluster.free_port()))
    _running_past(slurm, job, run_dir, 7)
    subprocess.run(["scancel", job], env=slurm, check=True, timeout=30)
    final = _wait(slurm, job, {"CANCELLED", "COMPLETED", "FAILED"})
    assert final["JobState"] == "CANCELLED"
    committed, problems = committed_checkpoints(run_dir / "checkpoints")
    assert not problems
    steps = [c.step for c in committed]
    assert 5 in steps and steps[-1] >= 7  # the interval's and the one SIGTERM asked for
    for c in committed:
        verify_checkpoint(c.path)  # every file's checksum as its manifest records it
    assert "requeueing" not in (run_dir / f"slurm-{job}.log").read_text()


def _log_has(path: Path, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + hang_guard_s(timeout)
    while time.monotonic() < deadline:
        if path.is_file() and text in path.read_text():
            return
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {path}")


def test_time_limit_before_step_1_ends_without_requeue(
    slurm: dict[str, str], spec: Path, tmp_path: Path
) -> None:
    """The time limit's warning as soon as the attempt has started, before any step: nothing
    is saved, so the job is not requeued (it would only stop the same way, as it used to three
    times): one line says so, and the job ends FAILED, not COMPLETED."""
    run_dir = tmp_path / "early"
    job = _sbatch(slurm, _script(slurm, spec, run_dir, slurm_cluster.free_port()))
    log = run_dir / f"slurm-{job}.log"
    _log_has(log, f"aihpc: job {job} (requeues 0) on")
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm, check=True, timeout=30)
    final = _wait(slurm, job, {"COMPLETED", "FAILED", "CANCELLED"})
    text = log.read_text()
    assert _steps(run_dir) == 0 and not committed_checkpoints(run_dir / "checkpoints")[0], text
    assert final["JobState"] == "FAILED" and final["Restarts"] == "0", text
    ours = [ln for ln in text.splitlines() if ln.startswith("aihpc: ")]
    assert ours[-1].startswith(
        "aihpc: no checkpoint newer than the start (none before) was committed in this attempt;"
        f" job {job} ends here, not requeued"
    ), text
    assert "requeueing" not in text and "Traceback" not in text


def test_cancelled_while_pending_is_not_a_success(
    slurm: dict[str, str], spec: Path, tmp_path: Path
) -> None:
    """A job cancelled before it ran: `aihpc launch --submit` says so and exits non-zero (it
    used to print "exit code 0", Slurm's record for a job that never ran)."""
    blocker = subprocess.run(
        ["sbatch", "--parsable", "--exclusive", "--output=/dev/null", "--wrap", "sleep 600"],
        env=slurm, capture_output=True, text=True, timeout=30, check=True,
    ).stdout.strip()  # fmt: skip
    out, doc = tmp_path / "follow.txt", tmp_path / "follow.json"
    try:
        _wait(slurm, blocker, {"RUNNING"})
        with open(out, "w") as f, open(doc, "w") as j:
            follower = subprocess.Popen(
                [sys.executable, "-m", "aihpc", "launch", str(spec), "--run-dir",
                 str(tmp_path / "run"), "--no-gpus", "--submit", "--json"],
                env=slurm, stdout=j, stderr=f, text=True,
            )  # fmt: skip
        try:
            job = _job_id(out)
            _wait(slurm, job, {"PENDING"})
            subprocess.run(["scancel", job], env=slurm, check=True, timeout=30)
            code = follower.wait(timeout=hang_guard_s(120))
        finally:
            follower.kill()
    finally:
        subprocess.run(["scancel", blocker], env=slurm, timeout=30)
    lines = out.read_text().splitlines()
    assert code == 1, lines
    said = rf"job {job} CANCELLED( \(\w+\))?: cancelled while pending: it never ran; exit code 1"
    assert re.fullmatch(said, lines[-1]), lines
    result = json.loads(doc.read_text())
    assert result["state"] == "CANCELLED" and result["exit_code"] == 1 and not result["ran"]
