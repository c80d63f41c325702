"""``aihpc launch RUN.toml --framework megatron|torchtitan``: the sbatch script that runs the
plan's export (``aihpc export``) under the framework itself, as the frameworks' own Slurm
examples do: one task per node (``srun --ntasks-per-node=1``) runs torchrun for the node's
GPUs, meeting the other nodes in a c10d rendezvous on the allocation's first node
(torchtitan's ``multinode_trainer.slurm``; Megatron-LM's example scripts run torchrun with
``MASTER_ADDR`` / ``MASTER_PORT``, which the exported script reads).

The allocation, the node's CPUs and exclusivity, the NCCL environment and ``--env`` are those of
``aihpc launch``'s own script (aihpc.interop.slurm). The rendezvous port is picked per job in
the script itself (the framework's node need not have aihpc): from the job id into
20000..31999, the next one when something listens there. No requeue: the framework's
checkpoints are not ones aihpc can verify, so the script does not claim one (``--requeue`` and
a checkpoint on SIGTERM are the framework's, e.g. Megatron-LM's ``--exit-signal-handler``).
"""

from __future__ import annotations

from pathlib import Path

from aihpc.interop._script import comment_text, env_name, shell_word
from aihpc.interop.slurm import (
    SlurmOptions,
    _cpu_lines,
    _directives,
    cpu_request,
    nccl_env,
    node_layout,
)
from aihpc.runspec import RunSpec, SpecError

__all__ = ["FRAMEWORK_FILES", "framework_sbatch"]

# the export each framework's job runs, written into the run directory
FRAMEWORK_FILES = {"megatron": "megatron.sh", "torchtitan": "torchtitan.toml"}

_PORT = [
    "# torchrun's c10d port on this (the first) node: from the job id, the next one while",
    "# something listens there",
    "rdzv_port=$((20000 + SLURM_JOB_ID % 12000))",
    'while (exec 3<>"/dev/tcp/127.0.0.1/$rdzv_port") 2>/dev/null; do'
    " rdzv_port=$((rdzv_port + 1)); done",
]


def framework_sbatch(
    spec: RunSpec, runspec_path: Path, opts: SlurmOptions, framework: str, config: Path
) -> str:
    """The batch script that runs ``config`` (the plan exported for ``framework``)."""
    if framework not in FRAMEWORK_FILES:
        raise SpecError("--framework", framework, "aihpc | " + " | ".join(FRAMEWORK_FILES))
    nodes, per_node = node_layout(spec)
    shell_word("--run-dir", opts.run_dir)
    run_dir = opts.run_dir.resolve()
    exclusive, cpus = cpu_request(spec, opts)
    lines = [
        "#!/bin/bash",
        f"# {framework} for {comment_text(runspec_path)} under Slurm: "
        f"{comment_text(spec.model.name)} on {spec.cluster.num_gpus} x "
        f"{comment_text(spec.cluster.gpu.id)}.",
        f"# Written by `aihpc launch --framework {framework}`; one task per node runs torchrun.",
        *_directives(opts, nodes, per_node, run_dir, exclusive, cpus, requeue=False),
        "",
        "set -uo pipefail",
    ]
    for name, value, why in nccl_env(spec):
        lines.append(f"export {name}={shell_word(name, value)}  # {why}")
    for name, value in opts.env:
        lines.append(f"export {env_name('--env', name)}={shell_word('--env', value)}")
    lines += _cpu_lines(cpus, per_node)
    lines += [
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        *(_PORT if opts.rdzv_port is None else [f"rdzv_port={int(opts.rdzv_port)}"]),
        'echo "aihpc: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, rendezvous $head_node:$rdzv_port"',
        'srun_args=(--kill-on-bad-exit=1 --ntasks-per-node=1 --cpus-per-task="$cpus")',
    ]
    word = shell_word("--output", config.resolve())
    if framework == "megatron":
        lines += [
            "# the exported script runs torchrun with MASTER_ADDR:MASTER_PORT as its rendezvous",
            'export MASTER_ADDR="$head_node" MASTER_PORT="$rdzv_port"',
            "# pretrain_gpt.py is Megatron-LM's: submit from its checkout, or set MEGATRON_LM",
            'cd "${MEGATRON_LM:-$SLURM_SUBMIT_DIR}" || exit 1',
            f'srun "${{srun_args[@]}}" bash {word}',
        ]
    else:
        python = shell_word("python", opts.python)
        lines += [
            "# torchtitan's multinode_trainer.slurm: srun + torchrun, c10d on the first node",
            f'srun "${{srun_args[@]}}" {python} -m torch.distributed.run \\',
            f"    --nnodes=$SLURM_JOB_NUM_NODES --nproc-per-node={per_node} \\",
            '    --rdzv-backend=c10d --rdzv-endpoint="$head_node:$rdzv_port" '
            '--rdzv-id="$SLURM_JOB_ID" \\',
            f"    -m torchtitan.train --job.config_file {word} \\",
            f"    --job.dump_folder {shell_word('--run-dir', run_dir)}",
        ]
    lines += ["rc=$?", 'echo "aihpc: training exited $rc"', 'exit "$rc"']
    return "\n".join(lines) + "\n"
