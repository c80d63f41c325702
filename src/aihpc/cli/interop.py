"""``aihpc import FRAMEWORK SOURCE`` and ``aihpc export RUN.toml --to FRAMEWORK``: a plan in and
out of Megatron-LM, torchtitan and DeepSpeed, and a model in and out of a Hugging Face
config.json."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import typer

from aihpc._io import write_atomic
from aihpc.cli._common import RUNSPEC_HELP, err_console, guarded, print_json
from aihpc.runspec import SpecError, load_runspec
from aihpc.runspec.inputs import parse_json

__all__ = ["register"]

FRAMEWORKS = ("megatron", "torchtitan", "deepspeed", "hf")


def _read(path: Path, field: str) -> str:
    """The source's text, bounded in size (runspec.inputs): one line when it is not one."""
    from aihpc.runspec.inputs import read_input

    return read_input(path, field, "a text file")


def _warn(line: str) -> None:
    err_console.print(line, highlight=False, soft_wrap=True, markup=False)


def register(app: typer.Typer) -> None:
    _register_import(app)
    _register_export(app)


def _register_import(app: typer.Typer) -> None:
    @app.command("import")
    @guarded
    def import_(
        framework: str = typer.Argument(
            ..., help="megatron | torchtitan | deepspeed | hf | verl | slime"
        ),
        source: Path = typer.Argument(
            ...,
            help="Megatron: pretrain_gpt.py launch script or file of its arguments; torchtitan: "
            "job TOML; DeepSpeed: config JSON; hf: a Hugging Face config.json; verl: its config "
            "YAML or a script running verl.trainer.main_ppo; slime: its launch script.",
        ),
        model: str | None = typer.Option(
            None,
            "--model",
            help="DeepSpeed, verl, slime: a preset name or a Hugging Face config.json.",
        ),
        gpu: str = typer.Option("h100-sxm", "--gpu", help="GPU catalog id of the cluster."),
        num_gpus: int | None = typer.Option(
            None,
            "--num-gpus",
            help="GPUs of the job, where the source does not say (verl: over trainer.nnodes x "
            "n_gpus_per_node).",
        ),
        gpus_per_node: int | None = typer.Option(None, "--gpus-per-node", help="GPUs per node."),
        vocab_size: int | None = typer.Option(
            None, "--vocab-size", help="Megatron: the tokenizer's size, where no flag gives it."
        ),
        seq_length: int | None = typer.Option(
            None,
            "--seq-length",
            help="DeepSpeed, hf: training sequence length (default: the model's).",
        ),
        global_batch_size: int | None = typer.Option(
            None,
            "--global-batch-size",
            help="hf: sequences per step (default: about 4M tokens).",
        ),
        output: Path | None = typer.Option(None, "-o", "--output", help="Write the run spec here."),
        as_json: bool = typer.Option(False, "--json", help="Print tables and warnings as JSON."),
        response_len: int | None = typer.Option(
            None,
            "--response-len",
            help="verl, slime: mean response tokens (default: half the cap).",
        ),
    ) -> None:
        """Read a Megatron-LM, torchtitan or DeepSpeed config (or a Hugging Face config.json) as
        a run spec: every field aihpc prices is carried, the framework's defaults applied; the
        rest is named in a warning."""
        if framework in RL_FRAMEWORKS:
            size = {"num_gpus": num_gpus, "gpus_per_node": gpus_per_node}
            imported = _import_rl(framework, source, model, gpu, response_len, size)
            imported.spec()
            _report_import(imported, source, output, as_json)
            return
        if framework not in FRAMEWORKS:
            allowed = (*FRAMEWORKS, *RL_FRAMEWORKS)
            raise SpecError("FRAMEWORK", framework, "allowed: " + " | ".join(allowed))
        cluster = {"gpu": gpu, "num_gpus": num_gpus, "gpus_per_node": gpus_per_node}
        options = {"vocab_size": vocab_size, "seq_length": seq_length}
        options["global_batch_size"] = global_batch_size
        imported = _import(framework, source, model, cluster, options)
        imported.spec()  # validated: SpecError names the field
        _report_import(imported, source, output, as_json)


RL_FRAMEWORKS = ("verl", "slime")


def _export_verl(spec: Any, runspec: Path, output: Path | None, as_json: bool) -> None:
    """`aihpc export --to verl`: the launch script, what the user must still name, and the RL
    step as verl runs it where that differs from the run spec's."""
    from aihpc.interop.verl_export import export_verl, verl_as_run
    from aihpc.perf.rl import estimate_rl

    text, notes = export_verl(spec, str(runspec))
    ran, changes = verl_as_run(spec)
    as_run = None
    if changes:
        ours, theirs = estimate_rl(spec), estimate_rl(ran)
        as_run = {
            "changes": changes,
            "step_time_s": theirs.step_time_s,
            "tokens_per_s_per_gpu": theirs.tokens_per_s_per_gpu,
            "fits": theirs.fits,
            "runspec_step_time_s": ours.step_time_s,
        }
    if output is not None:
        write_atomic(output, text, "--output")
    if as_json:
        print_json(
            {
                "framework": "verl",
                "config": text,
                "not_carried": notes,
                "as_run": as_run,
                "output": str(output) if output is not None else None,
                "model_out": None,
            }
        )
        return
    if output is None:
        sys.stdout.write(text)
    for note in notes:
        _warn(f"note: {note}")
    if as_run is not None:
        _warn(
            f"estimate as verl runs it: {as_run['step_time_s']:.1f} s/step, "
            f"{as_run['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU (the run spec's: "
            f"{as_run['runspec_step_time_s']:.1f} s/step), as it runs {'; '.join(changes)}"
        )
    if output is not None:
        _warn(f"verl launch script written to {output}")


def _import_rl(
    framework: str,
    source: Path,
    model: str | None,
    gpu: str,
    response_len: int | None,
    size: dict[str, int | None],
) -> Any:
    """verl's config (YAML, or a script of Hydra overrides) or slime's launch script; ``size``:
    --num-gpus and --gpus-per-node (verl: over its trainer.nnodes x n_gpus_per_node)."""
    text = _read(source, "SOURCE")
    config = None
    if model is not None and os.path.isfile(model):  # a Hugging Face config.json
        loaded = parse_json(_read(Path(model), "--model"), "--model", model)
        if not isinstance(loaded, dict):
            raise SpecError("--model", model, "expected a JSON object (a config.json)")
        config, model = loaded, None
    if framework == "verl":
        from aihpc.interop.verl import import_verl

        return import_verl(
            text, model=model, response_len=response_len, gpu=gpu, model_config=config, **size
        )
    for option, value in size.items():
        if value is not None:
            raise SpecError(
                "--" + option.replace("_", "-"),
                value,
                "not for slime: its --actor-num-nodes and --actor-num-gpus-per-node say it",
            )
    from aihpc.interop.slime import import_slime

    return import_slime(text, model=model, response_len=response_len, gpu=gpu, model_config=config)


def _import(framework: str, source: Path, model: str | None, cluster: dict, options: dict) -> Any:
    """The framework's reader on SOURCE (and, for DeepSpeed, the model --model names)."""
    from aihpc.interop import import_deepspeed, import_hf, import_megatron, import_torchtitan

    text = _read(source, "SOURCE")
    if framework == "megatron":
        return import_megatron(text, vocab_size=options["vocab_size"], **cluster)
    if framework == "torchtitan":
        return import_torchtitan(text, **cluster)
    if framework == "hf":
        return import_hf(
            text,
            str(source),
            seq_length=options["seq_length"],
            global_batch_size=options["global_batch_size"],
            **cluster,
        )
    model_text = None
    if model is not None and os.path.isfile(model):  # False, not OSError, for a long name
        model_text = _read(Path(model), "--model")
    return import_deepspeed(
        text, model=model, model_text=model_text, seq_length=options["seq_length"], **cluster
    )


def _report_import(imported: Any, source: Path, output: Path | None, as_json: bool) -> None:
    """The run spec written (-o) or printed, with its notes and what was not priced on stderr;
    with --json, one object instead of the printed spec."""
    toml = imported.toml(str(source))
    if output is not None:
        write_atomic(output, toml, "--output")
    if as_json:
        print_json(
            {"runspec": imported.tables, "not_priced": imported.unpriced, "notes": imported.notes}
        )
        return
    if output is None:
        sys.stdout.write(toml)
    for note in imported.notes:
        _warn(f"note: {note}")
    if imported.unpriced:
        _warn(
            f"warning: not priced ({len(imported.unpriced)} set in the source): "
            + ", ".join(imported.unpriced)
        )
    if output is not None:
        _warn(f"run spec written to {output}")


def _register_export(app: typer.Typer) -> None:
    @app.command("export")
    @guarded
    def export(
        runspec: Path = typer.Argument(..., help=RUNSPEC_HELP),
        to: str = typer.Option(
            ..., "--to", help="megatron | torchtitan | deepspeed | hf | verl (an [rl] spec)"
        ),
        output: Path | None = typer.Option(None, "-o", "--output", help="Write the config here."),
        model_out: Path | None = typer.Option(
            None, "--model-out", help="DeepSpeed: also write the model as a HF config.json."
        ),
        as_json: bool = typer.Option(
            False, "--json", help="Print one JSON object: the config text, notes, files written."
        ),
    ) -> None:
        """Write the run spec's plan as a Megatron-LM launch script, a torchtitan job TOML or a
        DeepSpeed config JSON (or its model as a Hugging Face config.json), or an [rl] plan as a
        verl launch script; a plan the framework cannot run is refused, naming the field."""
        from aihpc.interop import export_deepspeed, export_hf, export_megatron, export_torchtitan

        if to not in (*FRAMEWORKS, "verl"):
            raise SpecError("--to", to, "allowed: " + " | ".join((*FRAMEWORKS, "verl")))
        spec = load_runspec(runspec)
        if spec.vision is not None:  # the exports write a text model; its encoder would be lost
            raise SpecError(
                "RUNSPEC",
                str(runspec),
                "a vision-language run spec ([model.vision]) has no export yet",
            )
        if to == "verl":
            _export_verl(spec, runspec, output, as_json)
            return
        if to == "megatron":
            text, dropped = export_megatron(spec, str(runspec))
        elif to == "torchtitan":
            text, dropped = export_torchtitan(spec, str(runspec))
        elif to == "hf":
            text, dropped = export_hf(spec)
        else:
            text, model_json, dropped = export_deepspeed(spec)
            if model_out is not None:
                write_atomic(model_out, model_json, "--model-out")
        from aihpc.cli._frameworks import estimate_line

        ran_line, ran = estimate_line(to, spec)
        if output is not None:
            write_atomic(output, text, "--output")
        if as_json:
            print_json(
                {
                    "framework": to,
                    "config": text,
                    "not_carried": list(dropped),
                    "as_run": ran,
                    "output": str(output) if output is not None else None,
                    "model_out": str(model_out) if to == "deepspeed" and model_out else None,
                }
            )
            return
        if output is None:
            sys.stdout.write(text)
        if dropped:
            _warn("note: not carried: " + "; ".join(dropped))
        if ran_line is not None:
            _warn(ran_line)
        if output is not None:
            _warn(f"{to} config written to {output}")
