"""Crash drills: kill training at every file-system operation of save / commit / retention
(sync and async saves), at random steps, by an outside SIGKILL of one worker, and as a whole
job (SIGKILL of the launcher's process group); after each, check what a crash must never do.

    python benchmarks/crash_drills.py [--stride 1] [--random 10] [--external 6] [--whole 6]
        [--results benchmarks/results]

A trial passes when:
- every checkpoint committed at the moment of the crash verifies against its manifest;
- no worker outlives a killed launcher by more than 5 s (whole-job drills);
- the same command run again (or the agent's restart) finishes with the uninterrupted run's
  state_sha256 and the same loss at every step, bit for bit.

Operations are counted by aihpc.resilience.fsops (Python audit hooks: opens for writing,
renames, removes, mkdirs, truncates under the checkpoint folder), from the start of step 2's
save to the end of the run, so later saves and retention are included.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import add_results_arg, machine, save

SPEC = """
[model]
preset = "tiny-llama"
seq_length = 32
[cluster]
gpu = "h100-sxm"
num_gpus = 2
gpus_per_node = 2
[parallel]
zero_stage = {zero}
micro_batch_size = 1
global_batch_size = 2
[training]
train_steps = {steps}
warmup_steps = 1
[checkpoint]
interval_steps = 2
keep_last = 1
async_save = {async_save}
"""
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def spec_file(folder: Path, name: str, steps: int, async_save: bool, zero: int = 0) -> Path:
    path = folder / f"{name}.toml"
    path.write_text(SPEC.format(steps=steps, async_save=str(async_save).lower(), zero=zero))
    return path


def aihpc_train(spec: Path, run: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "aihpc", "train", str(spec), "--run-dir", str(run), "--json"]
    return subprocess.run([*cmd, *extra], capture_output=True, text=True, env=ENV, timeout=600)


def losses(run: Path) -> list[tuple[int, str]]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss_hex"]) for r in rows]


def committed_intact(run: Path) -> str | None:
    """None when every committed checkpoint verifies, else what is wrong."""
    from aihpc.resilience.manifest import CheckpointCorruptError, verify_checkpoint
    from aihpc.resilience.manifest import committed_checkpoints as committed

    infos, problems = committed(run / "checkpoints")
    if problems:
        return problems[0]
    for info in infos:
        try:
            verify_checkpoint(info.path)
        except CheckpointCorruptError as err:
            return str(err)
    return None


def same_as_reference(proc: subprocess.CompletedProcess, run: Path, ref: dict) -> str | None:
    if proc.returncode != 0:
        return f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
    summary = json.loads(proc.stdout)
    if summary["state_sha256"] != ref["state_sha256"]:
        return "state_sha256 differs from the uninterrupted run"
    if losses(run) != ref["losses"]:
        return "a step's loss differs from the uninterrupted run"
    return None


def reference(spec: Path, folder: Path, *extra: str) -> dict:
    run = folder / f"ref-{spec.stem}"
    proc = aihpc_train(spec, run, *extra)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {"state_sha256": json.loads(proc.stdout)["state_sha256"], "losses": losses(run)}


def fs_drill(folder: Path, async_save: bool, stride: int) -> list[dict]:
    """Kill before the K-th operation for K = 1, 1 + stride, ... until a run outlives them."""
    spec = spec_file(folder, f"fs-{async_save}", 6, async_save)
    ref = reference(spec, folder)
    trials, op = [], 1
    while True:
        run = folder / f"fs-{async_save}-{op}"
        killed = aihpc_train(spec, run, "--inject", f"kill:step=2:at=fs:op={op}")
        if killed.returncode == 0:
            break  # fewer operations than op: the drill has covered them all
        marker = next((run / "faults").glob("*"), None)
        what = json.loads(marker.read_text()).get("op", "?") if marker else "?"
        problem = None if killed.returncode == -signal.SIGKILL else f"exit {killed.returncode}"
        problem = problem or committed_intact(run)
        problem = problem or same_as_reference(aihpc_train(spec, run), run, ref)
        trials.append({"op": op, "operation": what, "passed": problem is None, "problem": problem})
        print(f"  fs {'async' if async_save else 'sync'} op {op:3d} {what:48s} "
              f"{'ok' if problem is None else problem}", flush=True)  # fmt: skip
        op += stride
    return trials


def random_step_drill(folder: Path, n: int, rng: random.Random) -> list[dict]:
    """Injected SIGKILL of a random rank at a random step; the agent restarts the job."""
    spec = spec_file(folder, "rand", 8, True, zero=3)
    ref = reference(spec, folder, "--nproc-per-node", "2")
    trials = []
    for i in range(n):
        step, rank = rng.randint(1, 8), rng.randint(0, 1)
        run = folder / f"rand-{i}"
        proc = aihpc_train(
            spec, run, "--nproc-per-node", "2", "--max-restarts", "1",
            "--inject", f"kill:step={step}:rank={rank}",
        )  # fmt: skip
        problem = same_as_reference(proc, run, ref)
        trials.append({"step": step, "rank": rank, "passed": problem is None, "problem": problem})
        print(f"  random kill step {step} rank {rank}: {problem or 'ok'}", flush=True)
    return trials


def _start(spec: Path, run: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "aihpc", "train", str(spec), "--run-dir", str(run), *extra]
    return subprocess.Popen(
        cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip


def _worker_pids(run: Path, min_step: int, timeout: float = 300) -> list[int] | None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            beats = [json.loads((run / "heartbeat" / f"rank-{r}.json").read_text()) for r in (0, 1)]
            if all(b["step"] >= min_step for b in beats):
                return [b["pid"] for b in beats]
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    return None


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines() or ['{"step": 0}']
    except OSError:
        return ['{"step": 0}']


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def outside_kill_drill(folder: Path, n: int, whole: bool, rng: random.Random) -> list[dict]:
    """SIGKILL from outside at a random moment (0-3 s into training): of one worker (the agent
    restarts the group), or of the launcher's whole process group (no worker may survive; a
    rerun resumes)."""
    spec = spec_file(folder, "outside", 120, True, zero=3)
    ref = reference(spec, folder, "--nproc-per-node", "2")
    trials = []
    for i in range(n):
        run, delay = folder / f"{'whole' if whole else 'one'}-{i}", rng.uniform(0.0, 3.0)
        extra = ("--nproc-per-node", "2") + (() if whole else ("--max-restarts", "1"))
        job = _start(spec, run, *extra)
        pids = _worker_pids(run, 1)
        time.sleep(delay)
        at_step = max(json.loads(x)["step"] for x in _lines(run / "metrics.jsonl")) if pids else 0
        problem = None if pids and job.poll() is None else "the job ended before the kill"
        if problem is None and whole:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(timeout=30)
            deadline = time.time() + 5
            while any(_alive(p) for p in pids) and time.time() < deadline:
                time.sleep(0.05)
            if any(_alive(p) for p in pids):
                problem = "a worker outlived the launcher by 5 s"
            problem = problem or committed_intact(run)
            problem = problem or same_as_reference(aihpc_train(spec, run, *extra), run, ref)
        elif problem is None:
            os.kill(rng.choice(pids), signal.SIGKILL)
            job.wait(timeout=600)
            summary = json.loads((run / "summary.json").read_text()) if job.returncode == 0 else {}
            if summary.get("state_sha256") != ref["state_sha256"] or losses(run) != ref["losses"]:
                problem = f"exit {job.returncode}, or the run differs from the reference"
        trials.append(
            {"delay_s": round(delay, 2), "about_step": at_step, "passed": problem is None,
             "problem": problem}
        )  # fmt: skip
        what = "whole job" if whole else "one worker"
        print(f"  {what} killed near step {at_step}: {problem or 'ok'}", flush=True)
    return trials


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stride", type=int, default=1, help="try every Nth file-system operation")
    ap.add_argument("--random", type=int, default=10, help="injected kills at random steps")
    ap.add_argument("--external", type=int, default=6, help="outside SIGKILLs of one worker")
    ap.add_argument("--whole", type=int, default=6, help="SIGKILLs of the whole job")
    ap.add_argument("--seed", type=int, default=0)
    add_results_arg(ap)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    groups: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="aihpc-drills-") as tmp:
        folder = Path(tmp)
        for mode in (False, True):
            name = f"kill at each file-system operation, {'async' if mode else 'sync'} saves"
            groups[name] = fs_drill(folder, mode, args.stride)
        groups["injected kill at a random step (2 ranks, agent restart)"] = random_step_drill(
            folder, args.random, rng
        )
        groups["outside SIGKILL of one worker (2 ranks, agent restart)"] = outside_kill_drill(
            folder, args.external, False, rng
        )
        groups["SIGKILL of the whole job's process group, then rerun"] = outside_kill_drill(
            folder, args.whole, True, rng
        )
    rows = [f"| {name} | {len(t)} | {sum(x['passed'] for x in t)} |" for name, t in groups.items()]
    failed = [f"- {name}: {x}" for name, t in groups.items() for x in t if not x["passed"]]
    md = "\n".join(
        ["| drill | tried | passed |", "|---|---:|---:|", *rows, "", *(failed or ["All passed."])]
    )
    save("crash_drills", {"machine": machine(), "groups": groups}, md, args.results)


if __name__ == "__main__":
    main()
