"""Recovery time: from a fault to the first resumed training step, split into its phases.

    python benchmarks/recovery_time.py [--nproc 2] [--repeats 2] [--hang-timeout 3]

Runs ``aihpc train --nproc-per-node N --max-restarts 1`` on the tiny preset with an injected
fault on the last rank, then reads the run's events.jsonl and the elastic agent's log:

- kill (SIGKILL): detection = kill → the agent logs the worker failure;
  hang (SIGSTOP): detection = stop → the heartbeat watchdog fires (bound: --hang-timeout);
- restart = detection → every new worker has its process group (teardown, rendezvous, spawn,
  interpreter and torch import, PG init);
- load = process group ready → checkpoint verified and loaded (all ranks);
- first step = loaded → first resumed step done.
Work lost (steps replayed) depends on the checkpoint interval and is reported separately.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import add_results_arg, machine, save

SPEC = """
[model]
preset = "tiny-llama"
[cluster]
gpu = "h100-sxm"
num_gpus = {nproc}
gpus_per_node = {nproc}
[parallel]
zero_stage = 3
micro_batch_size = 1
global_batch_size = {gbs}
[training]
train_steps = 14
warmup_steps = 2
[checkpoint]
interval_steps = 4
async_save = true
"""
_AGENT_FAIL = re.compile(r"^E(\d{4}) (\d\d:\d\d:\d\d\.\d+) .*\] failed \(exitcode", re.M)


def agent_failure_unix(stderr: str) -> float | None:
    m = _AGENT_FAIL.search(stderr)
    if not m:
        return None
    year = datetime.now(UTC).year
    stamp = datetime.strptime(f"{year}{m.group(1)} {m.group(2)}", "%Y%m%d %H:%M:%S.%f")
    return stamp.replace(tzinfo=UTC).timestamp()  # glog prints local time; the box runs UTC


def one_run(kind: str, nproc: int, hang_timeout: float, tmp: Path) -> dict:
    run = tmp / f"{kind}-{len(list(tmp.iterdir()))}"
    run.mkdir()
    spec = run / "run.toml"
    spec.write_text(SPEC.format(nproc=nproc, gbs=2 * nproc))
    fault = f"{kind}:step=6:rank={nproc - 1}"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "aihpc",
            "train",
            str(spec),
            "--run-dir",
            str(run / "out"),
            "--nproc-per-node",
            str(nproc),
            "--max-restarts",
            "1",
            "--hang-timeout",
            str(hang_timeout),
            "--inject",
            fault,
            "--json",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "TZ": "UTC"},
    )
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    ev = [json.loads(x) for x in (run / "out" / "events.jsonl").read_text().splitlines()]

    def times(name: str, attempt: int) -> list[float]:
        return [e["time_unix"] for e in ev if e["event"] == name and e["attempt"] == attempt]

    fault_t = times("fault", 0)[0]
    detected = agent_failure_unix(proc.stderr) if kind == "kill" else min(times("hang_detected", 0))
    pg = max(times("pg_ready", 1))
    spawned = max(
        e["process_start_unix"] for e in ev if e["event"] == "process_start" and e["attempt"] == 1
    )
    loaded = max(times("loaded", 1))
    first = max(times("first_step", 1))
    resumed = next(e["step"] for e in ev if e["event"] == "loaded" and e["attempt"] == 1)
    return {
        "detection_s": detected - fault_t,
        "restart_s": pg - detected,
        "restart_respawn_s": spawned - detected,
        "restart_init_s": pg - spawned,
        "load_s": loaded - pg,
        "first_step_s": first - loaded,
        "total_s": first - fault_t,
        "resumed_from_step": resumed,
        "steps_replayed": 6 - resumed,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--hang-timeout", type=float, default=3.0)
    add_results_arg(ap)
    args = ap.parse_args()
    results: dict[str, list[dict]] = {"kill": [], "hang": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for kind in results:
                results[kind].append(one_run(kind, args.nproc, args.hang_timeout, Path(tmp)))
    phases = (
        "detection_s",
        "restart_s",
        "restart_respawn_s",
        "restart_init_s",
        "load_s",
        "first_step_s",
        "total_s",
    )
    med = {k: {p: statistics.median(r[p] for r in rs) for p in phases} for k, rs in results.items()}
    rows = "\n".join(
        f"| {k} | " + " | ".join(f"{med[k][p]:.2f}" for p in phases) + " |" for k in results
    )
    md = (
        f"# Recovery time: fault → first resumed step ({args.nproc} ranks, CPU, gloo)\n\n"
        f"Tiny Llama preset, checkpoint every 4 steps (async), fault at step 6 on the last "
        f"rank, `--max-restarts 1`, hang bound {args.hang_timeout} s; median of "
        f"{args.repeats} runs per fault, seconds.\n\n"
        "| fault | detection | restart | (respawn | init) | load | first step | total |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|\n"
        + rows
        + "\n\nkill detection is torchrun's agent noticing the dead worker (monitor interval "
        "0.1 s); hang detection is the heartbeat watchdog (bound + poll). Restart = respawn "
        "(agent tears the group down, re-rendezvous, spawns) + init (Python, torch import, "
        "model build, process groups) on a shared 2-core machine."
    )
    save(
        "recovery_time",
        {
            "machine": machine(),
            "nproc": args.nproc,
            "hang_timeout_s": args.hang_timeout,
            "runs": results,
            "median": med,
        },
        md,
        results=args.results,
    )


if __name__ == "__main__":
    main()
