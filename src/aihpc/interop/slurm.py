"""``aihpc launch RUN.toml``: the sbatch script that runs ``aihpc train`` for the plan,
and (``--submit``) submitting it and following the job.

One Slurm task per node runs torchrun (``aihpc.runtime.torchrun``: torchrun's agent, whose stop
on a signal ends in one line), which starts the node's ranks and meets the other nodes through a
c10d rendezvous on the first node of the allocation. Preemption: ``--requeue`` lets Slurm
requeue the job; ``scontrol requeue``, preemption and ``scancel`` send SIGTERM to every process
of the job's steps, so the ranks finish the step, checkpoint and exit
(aihpc.resilience.preempt), and a requeued job resumes from that checkpoint.
``--signal=B:USR1@LEAD`` warns the batch script LEAD seconds before the time limit; it passes
SIGTERM to the steps with ``scancel --signal`` (a signal to srun itself would make srun kill its
tasks at once), waits for the checkpoint, then requeues the job.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from aihpc.interop._script import comment_text, directive_value, env_name, shell_word
from aihpc.runspec import RunSpec, SpecError

__all__ = ["JobState", "SlurmOptions", "follow_job", "job_state", "sbatch_script", "submit"]

# Job states after which the job will not run again (squeue/scontrol JobState names).
FINAL_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
    "DEADLINE", "SPECIAL_EXIT",
}  # fmt: skip


@dataclass(frozen=True)
class SlurmOptions:
    run_dir: Path
    job_name: str = "aihpc"
    partition: str | None = None
    account: str | None = None
    time_limit: str | None = None  # sbatch --time, e.g. "04:00:00"
    exclude: tuple[str, ...] = ()  # nodes never to run on (sbatch --exclude)
    signal_lead_s: int = 120  # SIGUSR1 to the batch script this long before the time limit
    gpus: bool = True  # request the node's GPUs (--gpus-per-node); off for a CPU partition
    cpus_per_task: int | None = None
    rdzv_port: int = 29500
    python: str = field(default_factory=lambda: sys.executable)
    env: tuple[tuple[str, str], ...] = ()  # extra exports (site NCCL settings, ...)
    train_args: tuple[str, ...] = ()  # more `aihpc train` options


def nccl_env(spec: RunSpec) -> list[tuple[str, str, str]]:
    """(name, value, why) for the NCCL / PyTorch environment the cluster spec calls for."""
    c = spec.cluster
    out = [
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1", "a failed collective ends the rank, not hangs"),
        ("NCCL_DEBUG", "WARN", "NCCL's warnings in the job log (aihpc doctor reads them)"),
    ]
    if c.num_nodes > 1:
        gbps = c.scale_out_bw_GBps * 8
        out.append(
            ("NCCL_IB_TIMEOUT", "22", f"scale-out fabric ({gbps:.0f} Gb/s per GPU): IB retries")
        )
        out.append(("NCCL_CROSS_NIC", "0", "rail-optimised: rank i of each node on NIC i"))
    if c.scale_up_domain > c.gpus_per_node:
        why = f"NVLink domain of {c.scale_up_domain} GPUs spans nodes"
        out.append(("NCCL_MNNVL_ENABLE", "1", why))
    return out


def sbatch_script(spec: RunSpec, runspec_path: Path, opts: SlurmOptions) -> str:
    """The batch script for ``spec`` (nodes and ranks from its cluster and plan)."""
    c = spec.cluster
    plan = spec.plan()
    per_node = min(c.gpus_per_node, c.num_gpus)
    nodes = max(1, plan.num_gpus // per_node)
    if nodes * per_node != plan.num_gpus:
        raise SpecError("cluster.num_gpus", c.num_gpus, f"a multiple of gpus_per_node {per_node}")
    if not 0 < opts.signal_lead_s < 3600:
        raise SpecError("--signal-lead", opts.signal_lead_s, "seconds in (0, 3600)")
    for flag, path in (("--run-dir", opts.run_dir), ("RUNSPEC", runspec_path)):
        shell_word(flag, path)  # before resolve(): a NUL or a newline never reaches the OS
    run_dir = opts.run_dir.resolve()
    spec_word = shell_word("RUNSPEC", runspec_path.resolve())
    directives = _directives(opts, nodes, per_node, run_dir)  # validated before any line
    lines = [
        "#!/bin/bash",
        f"# aihpc train {comment_text(runspec_path)} under Slurm: {comment_text(spec.model.name)}"
        f" on {c.num_gpus} x {comment_text(c.gpu.id)}, tp {plan.tp} pp {plan.pp} cp {plan.cp}"
        f" dp {plan.dp}.",
        "# Written by `aihpc launch`; one task per node runs torchrun for its ranks.",
        *directives,
    ]
    lines += ["", "set -uo pipefail"]
    for name, value, why in nccl_env(spec):
        lines.append(f"export {name}={shlex.quote(value)}  # {why}")
    for name, value in opts.env:
        lines.append(f"export {env_name('--env', name)}={shell_word('--env', value)}")
    lines.append(f"export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-{1 if per_node > 1 else 4}}}")
    lines.append(
        f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={opts.signal_lead_s}"
        "  # torchrun's wait for the ranks' last checkpoint (default 30 s)"
    )
    launch = [
        f"{shell_word('python', opts.python)} -m aihpc.runtime.torchrun",
        f"--nnodes=$SLURM_JOB_NUM_NODES --nproc-per-node={per_node}",
        f'--rdzv-backend=c10d --rdzv-endpoint="$head_node:{int(opts.rdzv_port)}"',
        '--rdzv-id="$SLURM_JOB_ID"',
        f"-m aihpc train {spec_word}",
        f"--run-dir {shell_word('--run-dir', run_dir)}",
    ]
    if opts.train_args:
        launch.append(" ".join(shell_word("train_args", a) for a in opts.train_args))
    lines += [
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'echo "aihpc: job $SLURM_JOB_ID (requeues ${SLURM_RESTART_COUNT:-0})'
        ' on $SLURM_JOB_NODELIST"',
        "",
        *_stop_handling(launch),
    ]
    return "\n".join(lines) + "\n"


# What a #SBATCH value may be: Slurm reads these lines itself (no shell quoting), so each value
# is held to the plain form its option takes; anything else could add an option or a line.
_NAME = r"[A-Za-z0-9_.+-]+"
# sbatch(1) --time: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S, or no limit (ASCII digits only)
_TIME = r"(?:[0-9]+(?::[0-9]+){0,2}|[0-9]+-[0-9]+(?::[0-9]+){0,2}|(?i:UNLIMITED|INFINITE))"
_PATH = r"[^\s\"'\\]+"  # no whitespace, quotes or backslashes (nor newlines: \s)


def _directives(opts: SlurmOptions, nodes: int, per_node: int, run_dir: Path) -> list[str]:
    """The script's ``#SBATCH`` lines: the allocation, the log, requeue and the warning.
    Every value is checked against the form Slurm takes; a bad one is refused naming its
    flag."""
    name = directive_value("job_name", opts.job_name, _NAME, "letters, digits and . _ + -")
    log_dir = directive_value(
        "--run-dir",
        run_dir,
        _PATH,
        "a path without spaces, quotes, backslashes or control characters "
        "(it goes into '#SBATCH --output')",
    ).replace("%", "%%")  # Slurm expands %j and the like in --output; %% is a literal %
    lines = [
        f"#SBATCH --job-name={name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if opts.gpus:
        lines.append(f"#SBATCH --gpus-per-node={per_node}")
    if opts.cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={int(opts.cpus_per_task)}")
    lines += [
        f"#SBATCH --output={log_dir}/slurm-%j.log",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
        f"#SBATCH --signal=B:USR1@{int(opts.signal_lead_s)}",
    ]
    site = (
        ("partition", opts.partition, rf"{_NAME}(?:,{_NAME})*", "a partition name or a list"),
        ("account", opts.account, _NAME, "an account name: letters, digits and . _ + -"),
        ("time", opts.time_limit, _TIME, "a Slurm time: M, M:S, H:M:S, D-H, D-H:M or D-H:M:S"),
    )
    for flag, value, pattern, allowed in site:
        if value:
            lines.append(
                f"#SBATCH --{flag}={directive_value(f'--{flag}', value, pattern, allowed)}"
            )
    for node in opts.exclude:
        directive_value(
            "--exclude", node, r"[A-Za-z0-9._\-\[\],]+", "a node name or Slurm hostlist"
        )
    if opts.exclude:
        lines.append(f"#SBATCH --exclude={','.join(opts.exclude)}")
    return lines


def _stop_handling(launch: list[str]) -> list[str]:
    """The script's srun and what it does on SIGTERM and on the time limit's SIGUSR1."""
    return [
        "# SIGTERM (scontrol requeue, preemption, scancel): Slurm signals every process of the",
        "# job's steps; the ranks finish their step, checkpoint and stop.",
        "# SIGUSR1 (the time limit is near): the same SIGTERM to the steps (a signal to srun would",
        "# make it kill its tasks at once), then the job requeues.",
        'stop=""',
        'trap \'stop=USR1; echo "aihpc: time limit near: final checkpoint";'
        ' scancel --signal=TERM "$SLURM_JOB_ID"\' USR1',
        "trap 'stop=TERM; echo \"aihpc: SIGTERM: final checkpoint\"' TERM",
        "srun --kill-on-bad-exit=1 --ntasks-per-node=1 \\",
        "    " + " \\\n    ".join(launch) + " &",
        "srun_pid=$!",
        'while :; do wait "$srun_pid"; rc=$?; kill -0 "$srun_pid" 2>/dev/null || break; done',
        "# after a signal, exit 0 means the ranks stopped with their checkpoint committed (its",
        "# one line is above); anything else is worth a line of its own",
        'if [ -z "$stop" ] || [ "$rc" != 0 ]; then echo "aihpc: training exited $rc"; fi',
        'if [ "$stop" = USR1 ]; then',
        '    echo "aihpc: time limit near: requeueing job $SLURM_JOB_ID"',
        "    trap - TERM",
        '    scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$rc"',
    ]


def _run(cmd: list[str]) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise SpecError("--submit", cmd[0], "Slurm's commands are not on PATH") from None
    if done.returncode:
        raise SpecError("--submit", " ".join(cmd[:2]), (done.stderr or done.stdout).strip()[:300])
    return done.stdout


def submit(script: Path) -> str:
    """sbatch the script; the job id."""
    return _run(["sbatch", "--parsable", str(script)]).strip().split(";")[0]


@dataclass(frozen=True)
class JobState:
    state: str
    reason: str
    exit_code: int | None
    signal: int | None
    restarts: int  # Slurm's Restarts: how many times the job was requeued (SLURM_RESTART_COUNT)
    nodes: str

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES


def job_state(job_id: str) -> JobState | None:
    """The job as ``scontrol show job`` sees it (None once Slurm has forgotten it)."""
    done = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60
    )
    if done.returncode:
        return None
    fields = dict(re.findall(r"(\w+)=(\S*)", done.stdout))
    code, _, sig = fields.get("ExitCode", "").partition(":")
    return JobState(
        state=fields.get("JobState", "UNKNOWN"),
        reason=fields.get("Reason", ""),
        exit_code=int(code) if code.isdigit() else None,
        signal=int(sig) if sig.isdigit() else None,
        restarts=int(fields.get("Restarts", "0") or 0),
        nodes=fields.get("NodeList", ""),
    )


def follow_job(
    job_id: str,
    log: Path,
    emit: Callable[[str], None],
    poll_s: float = 1.0,
    timeout_s: float | None = None,
) -> JobState | None:
    """Print the job's state changes and its new log lines until it ends; its last state."""
    seen, offset, last = "", 0, None
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        state = job_state(job_id)
        offset = _tail(log, offset, emit)
        if state is not None:
            last = state
            label = (
                f"{state.state} ({state.reason})"
                if state.reason not in ("", "None")
                else state.state
            )
            key = f"{label} {state.restarts}"
            if key != seen:
                where = f" on {state.nodes}" if state.state == "RUNNING" and state.nodes else ""
                again = f", requeues {state.restarts}" if state.restarts else ""
                emit(f"job {job_id}: {label}{where}{again}")
                seen = key
        if state is None or state.final:
            _tail(log, offset, emit)
            return last
        if deadline is not None and time.monotonic() > deadline:
            return last
        time.sleep(poll_s)


def _tail(log: Path, offset: int, emit: Callable[[str], None]) -> int:
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return offset
    end = data.rfind(b"\n") + 1  # whole lines only
    for line in data[:end].decode(errors="replace").splitlines():
        emit(f"  | {line}")
    return offset + end


def log_lines(log: Path) -> Iterator[str]:
    yield from log.read_text(errors="replace").splitlines()
