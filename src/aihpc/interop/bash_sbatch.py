"""The variables Slurm sets for a batch script from its ``#SBATCH`` lines (sbatch(1), OUTPUT
ENVIRONMENT VARIABLES), read as sbatch reads them: up to the first command, blank lines and
comments skipped. interop/bash.py gives them to the script it reads."""

from __future__ import annotations

__all__ = ["sbatch_env"]

# sbatch options -> the variables Slurm sets for the batch script from them (sbatch(1), OUTPUT
# ENVIRONMENT VARIABLES); a count only (a node range such as 2-4 is not known before it runs).
_SBATCH_ENV: dict[str, tuple[str, ...]] = {
    "--nodes": ("SLURM_NNODES", "SLURM_JOB_NUM_NODES"),
    "-N": ("SLURM_NNODES", "SLURM_JOB_NUM_NODES"),
    "--ntasks": ("SLURM_NTASKS", "SLURM_NPROCS"),
    "-n": ("SLURM_NTASKS", "SLURM_NPROCS"),
    "--ntasks-per-node": ("SLURM_NTASKS_PER_NODE",),
    "--gpus-per-node": ("SLURM_GPUS_PER_NODE", "SLURM_GPUS_ON_NODE"),
    "--cpus-per-task": ("SLURM_CPUS_PER_TASK",),
    "-c": ("SLURM_CPUS_PER_TASK",),
}


def sbatch_env(text: str) -> dict[str, tuple[str, str]]:
    """The variables the ``#SBATCH`` lines of ``text`` make Slurm set: {name: (value, note)}.
    sbatch reads those lines up to the first command (blank and comment lines skipped)."""
    opts: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or (stripped.startswith("#") and not stripped.startswith("#SBATCH")):
            continue
        if not stripped.startswith("#SBATCH"):
            break
        opts += stripped[len("#SBATCH") :].split("#", 1)[0].split()
    found: dict[str, tuple[str, str]] = {}  # option -> (value, as written)
    i = 0
    while i < len(opts):
        word = opts[i]
        name, eq, value = word.partition("=")
        if not eq and len(word) > 2 and word[:2] in ("-N", "-n", "-c") and word[1] != "-":
            name, value = word[:2], word[2:]
        elif not eq and word in _SBATCH_ENV and i + 1 < len(opts):
            value = opts[i + 1]
            word = f"{word} {value}"
            i += 1
        i += 1
        if name in _SBATCH_ENV and value:
            found[name] = (value.rsplit(":", 1)[-1] if name == "--gpus-per-node" else value, word)
    out: dict[str, tuple[str, str]] = {}
    for opt, (value, written) in found.items():
        if value.isdigit():
            for var in _SBATCH_ENV[opt]:
                out[var] = (str(int(value)), f"{var} = {int(value)} from #SBATCH {written}")
    nodes, per_node = found.get("--nodes") or found.get("-N"), found.get("--ntasks-per-node")
    if "SLURM_NTASKS" not in out and nodes and per_node and (nodes[0] + per_node[0]).isdigit():
        total = int(nodes[0]) * int(per_node[0])
        for var in ("SLURM_NTASKS", "SLURM_NPROCS"):
            why = f"#SBATCH {nodes[1]} x {per_node[1]}"
            out[var] = (str(total), f"{var} = {total} from {why}")
    return out
