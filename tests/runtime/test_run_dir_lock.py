"""One job per run directory, for every launcher: torchrun (torch's own and aihpc.runtime.torchrun),
srun (its SLURM_* environment, ranks started as separate processes), aihpc train's own agent and
a bare single process. A first job trains, and its rank 0 stops itself after step 1 (an injected
hang, SIGSTOP), so the job holds RUN_DIR/LOCK for as long as the second job takes on a loaded
machine; the second job on the same directory must exit 2 with one line naming
the holder, without writing anything there; then the first job goes on and ends exactly as an
undisturbed run of the same spec. Real processes and gloo, no mocks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_cli import losses, ok
from train_cli import train as run_train

from aihpc.runtime.distributed import free_port
from hang_bounds import hang_guard_s

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SPEC = """
[model]
preset = "tiny-llama"
seq_length = 32
[cluster]
gpu = "h100-sxm"
num_gpus = 2
gpus_per_node = 2
[parallel]
zero_stage = 0
micro_batch_size = 1
global_batch_size = 2
[training]
train_steps = 6
learning_rate = 3e-3
warmup_steps = 1
seed = 3
[checkpoint]
interval_steps = 2
keep_last = 2
async_save = false
"""
REFUSED = "is in use by PID"
# The first job's rank 0 stops itself (SIGSTOP) after step 1, holding its lock while the second
# job tries, however long that takes on a loaded machine; its watchdog allows the pause.
STOP_AT_STEP_1 = ["--inject", "hang:step=1:rank=0:mode=stop", "--hang-timeout", "1800"]


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", **extra}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    for name in [n for n in env if n.startswith(("SLURM_", "TORCHELASTIC_", "AIHPC_"))]:
        env.pop(name)
    return {**env, **extra}


def _train_args(spec: Path, run: Path, *extra: str) -> list[str]:
    return ["-m", "aihpc", "train", str(spec), "--run-dir", str(run), "--json", *extra]


def _torchrun(module: str, spec: Path, run: Path, *extra: str, restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", module, "--standalone", f"--max-restarts={restarts}",
            "--nproc-per-node", "2", *_train_args(spec, run, *extra)]  # fmt: skip


def _srun_ranks(spec: Path, run: Path, out: Path, *extra: str) -> list[subprocess.Popen]:
    """Two ranks as srun starts them: one process each, the job's SLURM_* set, env://."""
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = _env(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS="2",
                   SLURM_JOB_ID="4242", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)  # fmt: skip
        cmd = [sys.executable, *_train_args(spec, run, *extra)]
        procs.append(_start(cmd, env, out, f"rank{rank}"))
    return procs


def _start(cmd: list[str], env: dict[str, str], out: Path, name: str) -> subprocess.Popen:
    # output to files: a pipe nobody reads while the job runs could fill and block it
    with open(out / f"{name}.out", "w") as stdout, open(out / f"{name}.err", "w") as stderr:
        return subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr, text=True)


def _finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[int]:
    return [p.wait(timeout=hang_guard_s(timeout)) for p in procs]


def _beats(run: Path) -> dict[int, dict]:
    out = {}
    for path in (run / "heartbeat").glob("rank-*.json"):
        try:
            beat = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        out[beat["rank"]] = beat
    return out


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def _rank0_stopped(run: Path, procs: list[subprocess.Popen], world: int) -> dict[int, dict]:
    """Every rank's heartbeat once rank 0 has stopped itself after step 1 (STOP_AT_STEP_1):
    the job holds the lock, and cannot end, until the test lets it go on (SIGCONT)."""
    deadline = time.monotonic() + hang_guard_s(180)
    while time.monotonic() < deadline:
        beats = _beats(run)
        if len(beats) == world and _stopped(beats[0]["pid"]):
            return beats
        assert all(p.poll() is None for p in procs), "the first job ended before its step 1"
        time.sleep(0.1)
    raise AssertionError("the first job's rank 0 did not stop after step 1")


def _holder(run: Path) -> dict:
    return json.loads((run / "LOCK").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The same spec on 2 ranks, undisturbed (aihpc train's agent)."""
    d = tmp_path_factory.mktemp("ref")
    spec = d / "run.toml"
    spec.write_text(SPEC)
    summary = ok(run_train(spec, d / "run", "--nproc-per-node", "2", env={"OMP_NUM_THREADS": "1"}))
    return {"state_sha256": summary["state_sha256"], "losses": losses(d / "run")}


def _second_job_refused(run: Path, stopped: int, holder_pid: int, second) -> str:
    """While ``stopped`` is stopped (its job holds the lock): run ``second()`` -> its combined
    output; check that it wrote nothing in ``run``, then let the first job go on."""
    lock_before = (run / "LOCK").read_text()
    beats_before = {r: b["pid"] for r, b in _beats(run).items()}
    logs_before = sorted((run / "logs").glob("*")) if (run / "logs").exists() else []
    try:
        output = second()
    finally:
        os.kill(stopped, signal.SIGCONT)
    refusals = [line for line in output.splitlines() if REFUSED in line]
    assert len(refusals) == 1, output[-3000:]  # one line per job, not one per rank
    assert f"PID {holder_pid} on host" in refusals[0] and "since" in refusals[0]
    # nothing of the second job in the directory: no heartbeat over the first job's, no error
    # log, the lock's record unchanged (its events: _first_job_unharmed)
    assert (run / "LOCK").read_text() == lock_before
    assert {r: b["pid"] for r, b in _beats(run).items()} == beats_before
    assert (sorted((run / "logs").glob("*")) if (run / "logs").exists() else []) == logs_before
    return refusals[0]


def _first_job_unharmed(
    run: Path, codes: list[int], out: Path, starts: int, reference: dict | None
) -> None:
    assert codes == [0] * len(codes), [(p.name, p.read_text()[-2000:]) for p in out.glob("*.err")]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_step"] == 6 and summary["resumed_from_step"] == 0
    started = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert len([e for e in started if e["event"] == "process_start"]) == starts  # its own only
    if reference is not None:
        assert summary["state_sha256"] == reference["state_sha256"]
        assert losses(run) == reference["losses"]


def test_torchrun(tmp_path, reference):
    """torchrun starts both jobs' workers: rank 0 holds the lock, the second job's ranks all
    exit 2 (torch's torchrun then reports its failure table and exits 1; aihpc.runtime.torchrun,
    the agent `aihpc launch` scripts run, exits 2 with the one line). The first job's rank 0 is
    killed after step 1 and torchrun restarts the group: the new rank 0 takes the lock its dead
    predecessor held, and stops itself after step 3 while the second job tries."""
    spec, run, out = tmp_path / "run.toml", tmp_path / "run", tmp_path
    spec.write_text(SPEC)
    faults = ["--inject", "kill:step=1:rank=0", "--inject", "hang:step=3:rank=0:mode=stop"]
    cmd = _torchrun("torch.distributed.run", spec, run, *faults, *STOP_AT_STEP_1[2:], restarts=1)
    restartable = _env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # pytorch#135712
    first = _start(cmd, restartable, out, "first")
    beats = _rank0_stopped(run, [first], 2)
    assert beats[0]["attempt"] == 1 and _holder(run)["pid"] == beats[0]["pid"]

    def second() -> str:
        raw = subprocess.run(
            _torchrun("torch.distributed.run", spec, run), env=_env(), capture_output=True,
            text=True, timeout=hang_guard_s(240),
        )  # fmt: skip
        assert raw.returncode != 0 and raw.stderr.count("exitcode  : 2") >= 1, raw.stderr[-3000:]
        ours = subprocess.run(
            _torchrun("aihpc.runtime.torchrun", spec, run), env=_env(), capture_output=True,
            text=True, timeout=hang_guard_s(240),
        )  # fmt: skip
        assert ours.returncode == 2 and "Traceback" not in ours.stderr, ours.stderr[-3000:]
        assert len([x for x in ours.stderr.splitlines() if REFUSED in x]) == 1, ours.stderr
        return raw.stdout + raw.stderr

    _second_job_refused(run, beats[0]["pid"], beats[0]["pid"], second)
    _first_job_unharmed(run, _finish([first]), out, 4, reference)  # 2 ranks x 2 attempts
    assert json.loads((run / "summary.json").read_text())["restarts"] == 1


def test_srun(tmp_path, reference):
    """srun starts every rank itself (SLURM_PROCID / SLURM_NTASKS, env:// rendezvous)."""
    spec, run, out = tmp_path / "run.toml", tmp_path / "run", tmp_path
    spec.write_text(SPEC)
    (out / "a").mkdir()
    first = _srun_ranks(spec, run, out / "a", *STOP_AT_STEP_1)
    beats = _rank0_stopped(run, first, 2)
    assert _holder(run)["pid"] == beats[0]["pid"]

    def second() -> str:
        (out / "b").mkdir()
        ranks = _srun_ranks(spec, run, out / "b")
        assert _finish(ranks) == [2, 2]  # every rank refused, together: none hangs
        rank1 = (out / "b" / "rank1.err").read_text()
        assert "error" not in rank1, rank1  # rank 0 says it for the job
        return "".join(
            (out / "b" / f"rank{r}.{s}").read_text() for r in (0, 1) for s in ("out", "err")
        )

    _second_job_refused(run, beats[0]["pid"], beats[0]["pid"], second)
    _first_job_unharmed(run, _finish(first), out / "a", 2, reference)


def test_aihpc_agent(tmp_path, reference):
    """`aihpc train --nproc-per-node 2` holds the lock in the launcher; its workers do not take
    it again. A rank 0 worker is stopped, which holds the job (and the launcher) in place."""
    spec, run, out = tmp_path / "run.toml", tmp_path / "run", tmp_path
    spec.write_text(SPEC)
    cmd = [sys.executable, *_train_args(spec, run), "--nproc-per-node", "2"]
    first = _start([*cmd, *STOP_AT_STEP_1], _env(), out, "first")
    beats = _rank0_stopped(run, [first], 2)
    assert _holder(run)["pid"] == first.pid

    def second() -> str:
        proc = subprocess.run(
            cmd, env=_env(), capture_output=True, text=True, timeout=hang_guard_s(240)
        )
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        return proc.stdout + proc.stderr

    _second_job_refused(run, beats[0]["pid"], first.pid, second)
    _first_job_unharmed(run, _finish([first]), out, 2, reference)


def test_bare_single_process(tmp_path):
    """`python -m aihpc train` without a launcher: the process holds the lock and trains."""
    spec, run, out = tmp_path / "run.toml", tmp_path / "run", tmp_path
    spec.write_text(SPEC)
    cmd = [sys.executable, *_train_args(spec, run)]
    first = _start([*cmd, *STOP_AT_STEP_1], _env(), out, "first")
    _rank0_stopped(run, [first], 1)
    assert _holder(run)["pid"] == first.pid

    def second() -> str:
        proc = subprocess.run(
            cmd, env=_env(), capture_output=True, text=True, timeout=hang_guard_s(240)
        )
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        return proc.stdout + proc.stderr

    _second_job_refused(run, first.pid, first.pid, second)
    _first_job_unharmed(run, _finish([first]), out, 1, None)
