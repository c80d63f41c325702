"""``aihpc launch RUN.toml``: the sbatch script that runs ``aihpc train`` for the plan,
and (``--submit``) submitting it and following the job.

One Slurm task per node runs torchrun (``aihpc.runtime.torchrun``: torchrun's agent, whose stop
on a signal ends in one line), which starts the node's ranks and meets the other nodes through a
c10d rendezvous on the first node of the allocation, on a port chosen free there when the job
starts (``aihpc.runtime.slurm_job``). The node's task gets the node's CPUs: a job that fills
nodes of several GPUs takes them whole (``--exclusive``), one that shares a node asks for its
share of the cores. Preemption: ``--requeue`` lets Slurm requeue the job; ``scontrol requeue``,
preemption and ``scancel`` send SIGTERM to every process of the job's steps, so the ranks
finish the step, checkpoint and exit (aihpc.resilience.preempt), and a requeued job resumes
from that checkpoint. ``--signal=B:USR1@LEAD`` warns the batch script LEAD seconds before the
time limit; it passes SIGTERM to the steps with ``scancel --signal`` (a signal to srun itself
would make srun kill its tasks at once), waits for the checkpoint, and requeues the job only
when a checkpoint newer than the attempt's first was committed and verified and the job has
been requeued fewer than ``--max-requeues`` times.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from aihpc.interop._script import comment_text, directive_value, env_name, shell_word
from aihpc.runspec import RunSpec, SpecError

__all__ = ["SlurmOptions", "cpu_request", "nccl_env", "node_layout", "sbatch_script"]

MAX_REQUEUES = 3  # the default cap on requeues (--max-requeues)


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
    cpus_per_task: int | None = None  # the node's one task's CPUs; None: see cpu_request
    node_cpus: int | None = None  # CPUs of a node of the partition (sinfo), when known
    exclusive: bool | None = None  # whole nodes; None: when the job fills multi-GPU nodes
    rdzv_port: int | None = None  # None: a free port chosen on the first node at start
    max_requeues: int = MAX_REQUEUES
    max_restarts: int = 0  # torchrun's restarts of a node's worker group
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


def node_layout(spec: RunSpec) -> tuple[int, int]:
    """(nodes, ranks per node) of the plan on the cluster."""
    c = spec.cluster
    per_node = min(c.gpus_per_node, c.num_gpus)
    nodes = max(1, spec.plan().num_gpus // per_node)
    if nodes * per_node != spec.plan().num_gpus:
        raise SpecError("cluster.num_gpus", c.num_gpus, f"a multiple of gpus_per_node {per_node}")
    return nodes, per_node


def cpu_request(spec: RunSpec, opts: SlurmOptions) -> tuple[bool, int | None]:
    """(whole nodes, CPUs of the node's one task; None: all the node's, read at start).

    A job that fills nodes of several GPUs takes them whole (``--exclusive``): its one task
    per node runs every rank there, and the data loaders, NCCL's proxy threads and the
    checkpoint writers want the node's cores, which a shared node would hand to a neighbour.
    A job on part of a node asks for its share, the node's CPUs x its GPUs / the node's GPUs
    (Slurm otherwise gives a task one CPU). ``--cpus-per-task`` and ``--exclusive`` /
    ``--no-exclusive`` override either."""
    c = spec.cluster
    _, per_node = node_layout(spec)
    if opts.cpus_per_task is not None and opts.cpus_per_task < 1:
        raise SpecError("--cpus-per-task", opts.cpus_per_task, "a positive integer")
    whole = per_node == c.gpus_per_node
    exclusive = opts.exclusive if opts.exclusive is not None else whole and c.gpus_per_node > 1
    if opts.cpus_per_task is not None:
        return exclusive, opts.cpus_per_task
    if exclusive:
        return True, None
    if opts.node_cpus is None:
        raise SpecError(
            "--cpus-per-task",
            None,
            f"needed for a job on {per_node} of a node's {c.gpus_per_node} GPU(s) when sinfo "
            "does not give the partition's CPUs per node (or --exclusive for whole nodes)",
        )
    return False, max(1, opts.node_cpus * per_node // c.gpus_per_node)


def sbatch_script(spec: RunSpec, runspec_path: Path, opts: SlurmOptions) -> str:
    """The batch script for ``spec`` (nodes and ranks from its cluster and plan)."""
    c = spec.cluster
    plan = spec.plan()
    nodes, per_node = node_layout(spec)
    if not 0 < opts.signal_lead_s < 3600:
        raise SpecError("--signal-lead", opts.signal_lead_s, "seconds in (0, 3600)")
    if opts.max_requeues < 0:
        raise SpecError("--max-requeues", opts.max_requeues, "an integer >= 0")
    if opts.max_restarts < 0:
        raise SpecError("--max-restarts", opts.max_restarts, "an integer >= 0")
    if opts.rdzv_port is not None and not 1024 <= opts.rdzv_port <= 65535:
        raise SpecError("--rdzv-port", opts.rdzv_port, "an unprivileged TCP port, 1024..65535")
    for flag, path in (("--run-dir", opts.run_dir), ("RUNSPEC", runspec_path)):
        shell_word(flag, path)  # before resolve(): a NUL or a newline never reaches the OS
    run_dir = opts.run_dir.resolve()
    spec_word = shell_word("RUNSPEC", runspec_path.resolve())
    exclusive, cpus = cpu_request(spec, opts)
    directives = _directives(opts, nodes, per_node, run_dir, exclusive, cpus)  # validated first
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
    python = shell_word("python", opts.python)
    run_word = shell_word("--run-dir", run_dir)
    lines += [
        *_cpu_lines(cpus, per_node),
        f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={opts.signal_lead_s}"
        "  # torchrun's wait for the ranks' last checkpoint (default 30 s)",
        f"python={python}",
        f"run_dir={run_word}",
        f"max_requeues={int(opts.max_requeues)}",
        'requeues="${SLURM_RESTART_COUNT:-0}"',
        *_traps(),
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'echo "aihpc: job $SLURM_JOB_ID (requeues $requeues) on $SLURM_JOB_NODELIST"',
        "# The batch script runs on the allocation's first node, the rendezvous host: a port free",
        "# there (from one the job id picks), the newest committed checkpoint, and the cap on",
        "# requeues (a job requeued more than --max-requeues times stops here).",
        "start=$(date +%s)",
        'started=$("$python" -m aihpc.runtime.slurm_job start "$run_dir" "$SLURM_JOB_ID" \\',
        f'    "$requeues" "$max_requeues" {opts.rdzv_port or 0})',
        'read -r rdzv_port start_step <<<"$started"',
        'if [ -z "${start_step:-}" ]; then exit 1; fi',
        "",
    ]
    launch = [
        '"$python" -m aihpc.runtime.torchrun',
        f"--nnodes=$SLURM_JOB_NUM_NODES --nproc-per-node={per_node}",
        '--rdzv-backend=c10d --rdzv-endpoint="$head_node:$rdzv_port"',
        '--rdzv-id="$SLURM_JOB_ID"',
    ]
    if opts.max_restarts:
        launch.append(f"--max-restarts={int(opts.max_restarts)}")
    launch += [f"-m aihpc train {spec_word}", '--run-dir "$run_dir"']
    if opts.train_args:
        launch.append(" ".join(shell_word("train_args", a) for a in opts.train_args))
    lines += _run_and_requeue(launch)
    return "\n".join(lines) + "\n"


def _cpu_lines(cpus: int | None, per_node: int) -> list[str]:
    """``cpus``: the CPUs srun gives the node's task (all of a whole node's, the least over the
    job's nodes), and the ranks' OpenMP threads (an even share, unless set)."""
    if cpus is None:
        first = [
            "# every CPU of the node (the job has its nodes whole): the least over the nodes of",
            '# SLURM_JOB_CPUS_PER_NODE ("72(x2),36")',
            "cpus=$(tr ',' '\\n' <<<\"${SLURM_JOB_CPUS_PER_NODE:-1}\" | sed 's/(.*//' | sort -n"
            " | head -n 1)",
        ]
    else:
        first = [f"cpus={int(cpus)}  # the node's task's CPUs (#SBATCH --cpus-per-task)"]
    return [
        *first,
        f"export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-$(( cpus / {per_node} > 0 ? "
        f"cpus / {per_node} : 1 ))}}  # the CPUs of each of the node's {per_node} rank(s)",
    ]


# What a #SBATCH value may be: Slurm reads these lines itself (no shell quoting), so each value
# is held to the plain form its option takes; anything else could add an option or a line.
_NAME = r"[A-Za-z0-9_.+-]+"
# sbatch(1) --time: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S, or no limit (ASCII digits only)
_TIME = r"(?:[0-9]+(?::[0-9]+){0,2}|[0-9]+-[0-9]+(?::[0-9]+){0,2}|(?i:UNLIMITED|INFINITE))"
_PATH = r"[^\s\"'\\]+"  # no whitespace, quotes or backslashes (nor newlines: \s)


def _directives(
    opts: SlurmOptions,
    nodes: int,
    per_node: int,
    run_dir: Path,
    exclusive: bool,
    cpus: int | None,
    requeue: bool = True,
) -> list[str]:
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
    if exclusive:
        lines.append("#SBATCH --exclusive")
    if cpus is not None:
        lines.append(f"#SBATCH --cpus-per-task={int(cpus)}")
    lines += [
        f"#SBATCH --output={log_dir}/slurm-%j.log",
        "#SBATCH --open-mode=append",
    ]
    if requeue:
        lines += ["#SBATCH --requeue", f"#SBATCH --signal=B:USR1@{int(opts.signal_lead_s)}"]
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


def _traps() -> list[str]:
    """What the script does on SIGTERM and on the time limit's SIGUSR1 (set first: a signal
    before its trap would end the script with no line)."""
    return [
        "# SIGTERM (scontrol requeue, preemption, scancel): Slurm signals every process of the",
        "# job's steps; the ranks finish their step, checkpoint and stop.",
        "# SIGUSR1 (the time limit is near): the same SIGTERM to the steps (a signal to srun would",
        "# make it kill its tasks at once); the job requeues if that saved a newer checkpoint.",
        'stop=""',
        "trap 'stop=USR1; echo \"aihpc: time limit near: asking the ranks for a final"
        ' checkpoint"; scancel --signal=TERM "$SLURM_JOB_ID"\' USR1',
        "trap 'stop=TERM; echo \"aihpc: SIGTERM: asking the ranks for a final checkpoint\"' TERM",
    ]


def _run_and_requeue(launch: list[str]) -> list[str]:
    """The script's srun, and at the time limit the requeue: only when
    ``aihpc.runtime.slurm_job requeue`` finds a checkpoint newer than the attempt's first
    committed and verified, and the cap not reached."""
    return [
        'if [ -n "$stop" ]; then  # the signal came before the step: no training to stop',
        '    echo "aihpc: SIG$stop came before training started"',
        '    rc=$((128 + $(kill -l "$stop")))',
        "else",
        '    srun --kill-on-bad-exit=1 --ntasks-per-node=1 --cpus-per-task="$cpus" \\',
        "        " + " \\\n        ".join(launch) + " &",
        "    srun_pid=$!",
        "    # a signal after the check above and before slurmctld lists the step reached no step",
        "    # (scancel signals the job's steps): once the step is listed (30 s at most), send it",
        "    # on again",
        "    for _ in $(seq 150); do",
        '        squeue -h -s -j "$SLURM_JOB_ID" -o %i 2>/dev/null | grep -q "\\.[0-9]" && break',
        '        kill -0 "$srun_pid" 2>/dev/null || break',
        "        sleep 0.2",
        "    done",
        '    if [ -n "$stop" ]; then scancel --signal=TERM "$SLURM_JOB_ID"; fi',
        '    while :; do wait "$srun_pid"; rc=$?; kill -0 "$srun_pid" 2>/dev/null || break; done',
        "    # after a signal, exit 0 means the ranks stopped with their checkpoint committed",
        "    # (its one line is above); anything else is worth a line of its own",
        '    if [ -z "$stop" ] || [ "$rc" != 0 ]; then echo "aihpc: training exited $rc"; fi',
        "fi",
        'if [ "$stop" = USR1 ]; then',
        "    # one line: the verified checkpoint and the requeue, or why the job stops here",
        '    "$python" -m aihpc.runtime.slurm_job requeue "$run_dir" "$SLURM_JOB_ID" \\',
        '        "$requeues" "$max_requeues" "$start_step" "$start"',
        "    case $? in",
        '        0) trap - TERM; scontrol requeue "$SLURM_JOB_ID" ;;',
        "        3) ;;  # training had finished: nothing to requeue",
        '        *) if [ "$rc" = 0 ]; then rc=1; fi ;;  # no progress saved, or the cap reached',
        "    esac",
        "fi",
        'exit "$rc"',
    ]
