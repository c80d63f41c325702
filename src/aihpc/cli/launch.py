"""``aihpc launch RUN.toml --run-dir DIR``: the sbatch script that runs ``aihpc train`` for the
plan on a Slurm cluster, and (``--submit``) the job, followed to its end.

Every ``aihpc train`` option but the ones the launch decides (the run spec, ``--run-dir``,
``--nproc-per-node``: the plan's GPUs per node, ``--json``) is an option of ``aihpc launch``
too, taken from train's own declaration when the command is built, so the two cannot drift: a
value given is checked here as far as the login node can, and passed to every rank
(``--max-restarts`` to each node's torchrun, whose worker group it restarts).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import re
import subprocess
from pathlib import Path
from typing import Any

import typer

from aihpc._io import write_atomic
from aihpc.cli._common import RUNSPEC_HELP, err_console, guarded, print_json
from aihpc.runspec import RunSpec, SpecError, load_runspec

__all__ = ["register", "train_passthrough"]

# train's parameters the launch decides itself
_NOT_PASSED = ("runspec", "run_dir", "nproc_per_node", "as_json")
TRAIN_PANEL = "aihpc train options (passed to every rank)"


def _warn(line: str) -> None:
    err_console.print(line, highlight=False, soft_wrap=True, markup=False)


def train_passthrough() -> list[inspect.Parameter]:
    """``aihpc train``'s options that a launch passes on, as train declares them."""
    from aihpc.cli import train as train_cli

    tree = typer.Typer()
    train_cli.register(tree)
    (command,) = tree.registered_commands
    params = inspect.signature(command.callback, eval_str=True).parameters.values()
    out = []
    for p in params:
        if p.name in _NOT_PASSED:
            continue
        info = copy.copy(p.default)
        info.rich_help_panel = TRAIN_PANEL
        out.append(p.replace(default=info, kind=inspect.Parameter.KEYWORD_ONLY))
    return out


def _flag(param: inspect.Parameter) -> str:
    decls = [d for d in (param.default.param_decls or ()) if d.startswith("--")]
    return max(decls, key=len) if decls else "--" + param.name.replace("_", "-")


def _train_args(params: list[inspect.Parameter], values: dict[str, Any]) -> tuple[str, ...]:
    """The train options given (a value other than train's default), as train's flags.
    Paths become absolute: the ranks start in the job's working folder."""
    args: list[str] = []
    for p in params:
        value, default = values[p.name], p.default.default
        if p.name == "max_restarts" or value is None or value == default or value == []:
            continue
        flag = _flag(p)
        if isinstance(value, bool):  # "--x" or typer's "--x/--no-x"
            on, _, off = flag.partition("/")
            args.append(on if value else off or "--no-" + on[2:])
            continue
        for item in value if isinstance(value, list | tuple) else [value]:
            args += [flag, str(item.resolve() if isinstance(item, Path) else item)]
    return tuple(args)


def _check_train_values(spec: RunSpec, values: dict[str, Any], per_node: int) -> None:
    """What the login node can check of train's options before anything is submitted (each
    rank checks them all again where it runs)."""
    from aihpc.cli.observe import _listen_family
    from aihpc.cli.train import _check_faults, _check_timeout

    data = values.get("data")
    if data is not None and not data.is_file():
        what = "is a directory" if data.is_dir() else "file not found"
        raise SpecError("--data", str(data), f"{what}; expected UTF-8 text or a .npy token array")
    for name in ("hang_timeout", "startup_timeout"):
        if name in values:
            _check_timeout("--" + name.replace("_", "-"), values[name])
    if values.get("max_restarts", 0) < 0:
        raise SpecError("--max-restarts", values["max_restarts"], "an integer >= 0")
    if values.get("inject"):
        _check_faults(spec, values["inject"], spec.plan().num_gpus)
    port = values.get("metrics_port")
    if port is not None:
        if not 1 <= port <= 65536 - per_node:
            allowed = f"a TCP port in 1..{65536 - per_node} ({per_node} rank(s) per node)"
            raise SpecError("--metrics-port", port, allowed)
        _listen_family(values.get("metrics_host", "127.0.0.1"))
    textfile = values.get("metrics_textfile")
    if textfile is not None and textfile.exists() and not textfile.is_dir():
        raise SpecError("--metrics-textfile", str(textfile), "exists and is not a folder")


def _node_cpus(partition: str | None) -> int | None:
    """The fewest CPUs of a node of the partition (all partitions when None), as sinfo says;
    None when sinfo cannot be asked."""
    cmd = ["sinfo", "-h", "-o", "%c"] + (["-p", partition] if partition else [])
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    counts = [int(m) for m in re.findall(r"^\s*(\d+)", done.stdout, re.M)]
    return min(counts) if done.returncode == 0 and counts else None


def _env_pairs(env: list[str] | None) -> tuple[tuple[str, str], ...]:
    """``--env NAME=VALUE`` options as pairs; anything else is one line naming it."""
    pairs = []
    for item in env or []:
        name, eq, value = item.partition("=")
        if not eq or not name.isidentifier():
            raise SpecError("--env", item, "NAME=VALUE")
        pairs.append((name, value))
    return tuple(pairs)


def _launch(
    runspec: Path,
    run_dir: Path,
    output: Path | None,
    submit: bool,
    partition: str | None,
    account: str | None,
    time_limit: str | None,
    exclude: list[str] | None,
    signal_lead: int,
    gpus: bool,
    env: list[str] | None,
    rdzv_port: int | None,
    cpus_per_task: int | None,
    exclusive: bool | None,
    max_requeues: int,
    framework: str,
    follow_timeout: float | None,
    as_json: bool,
    slurm: bool,
    **train_values: Any,
) -> None:
    """Launch `aihpc train` for the run spec on a Slurm cluster: an sbatch script (nodes and
    ranks from the plan, the node's CPUs, srun + torchrun rendezvous on a free port, requeue
    with a verified final checkpoint on SIGUSR1 / SIGTERM, at most --max-requeues times);
    --submit submits it and follows the job. Every `aihpc train` option is passed to the
    ranks."""
    from aihpc.interop.slurm import SlurmOptions, node_layout, sbatch_script

    if framework not in ("aihpc", "megatron", "torchtitan"):
        raise SpecError("--framework", framework, "aihpc | megatron | torchtitan")
    del slurm  # --slurm was required until 0.2; Slurm is the one launcher there is
    if framework != "aihpc":
        _refuse_train_values(framework, train_values)
    spec = load_runspec(runspec)
    _, per_node = node_layout(spec)
    _check_train_values(spec, train_values, per_node)
    opts = SlurmOptions(
        run_dir=run_dir,
        job_name="aihpc-" + re.sub(r"[^A-Za-z0-9_.+-]", "_", runspec.stem),
        partition=partition,
        account=account,
        time_limit=time_limit,
        exclude=tuple(exclude or ()),
        signal_lead_s=signal_lead,
        gpus=gpus,
        env=_env_pairs(env),
        rdzv_port=rdzv_port,
        cpus_per_task=cpus_per_task,
        exclusive=exclusive,
        max_requeues=max_requeues,
        max_restarts=train_values.get("max_restarts", 0),
        train_args=_train_args(_PASSTHROUGH, train_values),
    )
    path = output or run_dir / "job.sbatch"
    if framework == "aihpc":
        script = _with_node_cpus(lambda o: sbatch_script(spec, runspec, o), opts)
    else:
        script, config, text = _framework_script(spec, runspec, opts, framework)
    run_dir.mkdir(parents=True, exist_ok=True)  # every check has passed
    if framework != "aihpc":
        write_atomic(config, text, "--run-dir")
        _warn(f"{framework} config written to {config}")
    write_atomic(path, script, "--output")
    result: dict = {"script": str(path), "run_dir": str(run_dir), "job_id": None}
    if not submit:
        if as_json:
            print_json(result)
            return
        _warn(f"sbatch script written to {path}; submit it with: sbatch {path}")
        return
    from aihpc.interop.slurm_jobs import submit as sbatch

    _submit_and_follow(sbatch(path), run_dir, result, follow_timeout, as_json)


def _with_node_cpus(build: Any, opts: Any) -> str:
    """``build(opts)``; a job on part of a node that needs the node's CPUs asks sinfo."""
    try:
        return build(opts)
    except SpecError as err:
        if err.field != "--cpus-per-task" or err.value is not None:
            raise
        node_cpus = _node_cpus(opts.partition)  # a job on part of a node: its share
        if node_cpus is None:
            raise
        return build(dataclasses.replace(opts, node_cpus=node_cpus))


def _refuse_train_values(framework: str, train_values: dict[str, Any]) -> None:
    """aihpc train's options have no meaning for another framework's trainer."""
    for p in _PASSTHROUGH:
        value = train_values[p.name]
        if value is not None and value != p.default.default and value != []:
            why = f"an aihpc train option; --framework {framework} runs the framework's trainer"
            raise SpecError(_flag(p), str(value) if isinstance(value, Path) else value, why)


def _framework_script(
    spec: RunSpec, runspec: Path, opts: Any, framework: str
) -> tuple[str, Path, str]:
    """(script, config path, config text): the plan exported for ``framework``, to be written
    into the run directory, and the script that runs it."""
    from aihpc.interop import export_megatron, export_torchtitan
    from aihpc.interop.slurm_frameworks import FRAMEWORK_FILES, framework_sbatch

    export = export_megatron if framework == "megatron" else export_torchtitan
    text, dropped = export(spec, str(runspec))
    config = opts.run_dir / FRAMEWORK_FILES[framework]
    script = _with_node_cpus(lambda o: framework_sbatch(spec, runspec, o, framework, config), opts)
    if dropped:
        _warn("note: not carried: " + "; ".join(dropped))
    return script, config, text


def _submit_and_follow(
    job_id: str, run_dir: Path, result: dict, follow_timeout: float | None, as_json: bool
) -> None:
    """Follow a submitted job (state, log, exit); exit 0 only for a job that completed with
    exit code 0, else with its code and one line saying how it ended."""
    from aihpc.interop.slurm_jobs import final_report, follow_job

    _warn(f"submitted job {job_id}; log {run_dir.resolve()}/slurm-{job_id}.log")
    log = run_dir.resolve() / f"slurm-{job_id}.log"
    last, ran = follow_job(job_id, log, _warn, timeout_s=follow_timeout)
    if last is None:
        raise SpecError("--submit", job_id, "Slurm no longer knows the job")
    code, line = final_report(job_id, last, ran) if last.final else (0, "")
    result.update(
        job_id=job_id,
        state=last.state,
        final=last.final,
        ran=ran,
        exit_code=code,
        requeues=last.restarts,
    )
    if as_json:
        print_json(result)
    if not last.final:
        _warn(f"job {job_id} still {last.state}; stopped following")
        return
    _warn(line)
    if code:
        raise typer.Exit(code)


_PASSTHROUGH: list[inspect.Parameter] = []


def _own_parameters() -> list[inspect.Parameter]:
    """launch's own options: the script's and sbatch's, then the job's."""
    kw = inspect.Parameter.KEYWORD_ONLY
    own = _script_options() | _job_options()
    return [inspect.Parameter(n, kw, default=info, annotation=t) for n, (t, info) in own.items()]


def _script_options() -> dict[str, tuple[Any, Any]]:
    """What the script is, where it goes, and what sbatch is asked for."""
    o = typer.Option
    return {
        "runspec": (Path, typer.Argument(..., help=RUNSPEC_HELP)),
        "slurm": (bool, o(True, "--slurm", hidden=True, help="Slurm (the default).")),
        "run_dir": (Path, o(..., "--run-dir", help="Checkpoints, metrics, job log.")),
        "output": (
            Path | None,
            o(None, "-o", "--output", help="Script path (default: RUN_DIR/job.sbatch)."),
        ),
        "submit": (bool, o(False, "--submit", help="sbatch it and follow the job.")),
        "partition": (str | None, o(None, "--partition", help="sbatch --partition.")),
        "account": (str | None, o(None, "--account", help="sbatch --account.")),
        "time_limit": (str | None, o(None, "--time", help="sbatch --time (H:MM:SS).")),
        "exclude": (
            list[str] | None,
            o(None, "--exclude", help="Node never to run on (repeatable; a Slurm hostlist)."),
        ),
        "signal_lead": (
            int,
            o(
                120,
                "--signal-lead",
                help="Seconds before the time limit to checkpoint and requeue.",
            ),
        ),
        "gpus": (bool, o(True, "--gpus/--no-gpus", help="Request GPUs (--gpus-per-node).")),
        "env": (
            list[str] | None,
            o(None, "--env", help="NAME=VALUE exported in the script (repeatable)."),
        ),
    }


def _job_options() -> dict[str, tuple[Any, Any]]:
    """How the job runs: its rendezvous, CPUs, requeues, trainer, and how it is followed."""
    o = typer.Option
    return {
        "rdzv_port": (
            int | None,
            o(
                None,
                "--rdzv-port",
                help="torchrun's c10d port (default: a free one on the first node, chosen "
                "when the job starts from one its job id picks).",
            ),
        ),
        "cpus_per_task": (
            int | None,
            o(
                None,
                "--cpus-per-task",
                help="CPUs of the node's one task (default: the whole node's for a job on "
                "whole nodes, else the node's CPUs x its share of the GPUs, from sinfo).",
            ),
        ),
        "exclusive": (
            bool | None,
            o(
                None,
                "--exclusive/--no-exclusive",
                help="Whole nodes (default: when the job fills nodes of several GPUs).",
            ),
        ),
        "max_requeues": (
            int,
            o(3, "--max-requeues", help="Requeues at most (time limit, preemption, failures)."),
        ),
        "framework": (
            str,
            o(
                "aihpc",
                "--framework",
                help="aihpc (aihpc train) | megatron | torchtitan: the job runs the plan's "
                "export (aihpc export) with the framework's own trainer.",
            ),
        ),
        "follow_timeout": (
            float | None,
            o(None, "--follow-timeout", help="Stop following after this many seconds."),
        ),
        "as_json": (
            bool,
            o(
                False,
                "--json",
                help="Print one JSON object at the end: script, job id, final state.",
            ),
        ),
    }


def register(app: typer.Typer) -> None:
    """``aihpc launch``, its options its own plus train's."""
    own = _own_parameters()
    _PASSTHROUGH[:] = train_passthrough()
    clash = {p.name for p in own} & {p.name for p in _PASSTHROUGH}
    if clash:
        raise RuntimeError(f"aihpc train and aihpc launch both declare {sorted(clash)}")
    command = guarded(_launch)
    params = [*own, *_PASSTHROUGH]
    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    app.command("launch", help=inspect.getdoc(_launch))(command)
