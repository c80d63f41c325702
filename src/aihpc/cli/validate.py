"""``aihpc validate``: the model's predictions against published measured runs (the shared,
held-out and MoE sets) or the user's own (--runs), as a Markdown table with MAPE per source."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from aihpc.cli import _common
from aihpc.cli._common import guarded, print_json
from aihpc.runspec import SpecError

if TYPE_CHECKING:  # the planner loads inside the command
    from aihpc.perf.fit.validate import ValidationReport

__all__ = ["register", "validation_table"]


VALIDATE_CALIBRATION = typer.Option(
    None,
    "--calibration",
    help="Price every run with this calibration TOML (e.g. from calibrate --runs).",
)
RUNS_TEMPLATE = typer.Option(
    False,
    "--runs-template",
    help="Print a runs CSV to fill in (every documented column, two example rows).",
)


def _print_runs_template(json_out: bool) -> None:
    from aihpc.perf.fit.runs_csv import template_text

    text = template_text()
    if json_out:
        print_json({"columns": text.splitlines()[0].split(","), "csv": text})
    else:
        typer.echo(text, nl=False)


RL_OPT = typer.Option(False, "--rl", help="The RL steps (NeMo-RL's published runs; docs/rl.md).")
INFERENCE_OPT = typer.Option(
    False,
    "--inference",
    help="The inference model against published serving runs (docs/inference.md).",
)
VLM_OPT = typer.Option(
    False, "--vlm", help="The vision-language runs (issue 40's set; with --runs, yours)."
)


def register(app: typer.Typer) -> None:
    @app.command()
    @guarded
    def validate(
        json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
        runs: Path | None = typer.Option(
            None,
            help="Runs CSV: your own measured runs (columns: --runs-template), or a published "
            "set (default: the project's copy).",
        ),
        memory: Path | None = typer.Option(
            None, help="Memory CSV (Korthikanti components; default: with the project's runs)."
        ),
        heldout: bool = typer.Option(
            False,
            "--heldout",
            help="The held-out runs: published, not in the shared set the model was developed on.",
        ),
        moe: bool = typer.Option(
            False, "--moe", help="The mixture-of-experts runs (issue 17's development set)."
        ),
        calibration: Path | None = VALIDATE_CALIBRATION,
        runs_template: bool = RUNS_TEMPLATE,
        rl: bool = RL_OPT,
        inference: bool = INFERENCE_OPT,
        vlm: bool = VLM_OPT,
    ) -> None:
        """Predicted vs measured tokens/s/GPU and memory on published runs or your own
        (--runs); MAPE per source."""
        from rich.progress import BarColumn, Progress, TextColumn

        from aihpc.perf.fit.validate import validate as run_validate

        if runs_template and not inference:
            _print_runs_template(json_out)
            return
        sets = (inference, vlm, rl)
        if _other_set(sets, json_out, runs, memory, heldout, moe, calibration):
            return
        cal = None
        if calibration is not None:
            from aihpc.runspec.calibration import load_calibration

            cal = load_calibration(calibration)

        for name, path in (("--runs", runs), ("--memory", memory)):
            if path is not None and not os.path.exists(path):  # False, not OSError, for any name
                raise SpecError(name, str(path), "file not found")
            if path is not None and (heldout or moe):
                flag = "--heldout" if heldout else "--moe"
                raise SpecError(name, str(path), f"not with {flag}, which names its own runs")
        if heldout and moe:
            raise SpecError("--moe", True, "not with --heldout: choose one set of runs")
        with Progress(
            TextColumn("validating {task.fields[row]}"),
            BarColumn(),
            console=_common.err_console,
            transient=True,
            disable=json_out or not _common.err_console.is_terminal,
        ) as bar:
            task = bar.add_task("validate", total=None, row="")
            report = run_validate(
                runs,
                memory,
                progress=lambda rid: bar.update(task, advance=1, row=rid),
                heldout=heldout,
                moe=moe,
                calibration=cal,
            )
        if json_out:
            print_json(report.to_json())
            return
        typer.echo(validation_table(report))
        if report.calibration:
            typer.echo(f"\nEvery row priced with the calibration {report.calibration}.")


def _other_set(
    sets: tuple[bool, bool, bool],
    json_out: bool,
    runs: Path | None,
    memory: Path | None,
    heldout: bool,
    moe: bool,
    calibration: Path | None,
) -> bool:
    """``--inference``, ``--vlm`` or ``--rl`` (one of them): validated here, True; none: False."""
    inference, vlm, rl = sets
    chosen = [name for name, on in zip(("--inference", "--vlm", "--rl"), sets, strict=True) if on]
    if len(chosen) > 1:
        raise SpecError(chosen[-1], True, f"not with {chosen[0]}: choose one set of runs")
    if inference:
        _validate_inference(json_out, heldout, runs, moe or calibration is not None)
    elif vlm:
        _validate_vlm(runs, memory, heldout, moe, calibration, json_out)
    elif rl:
        from aihpc.cli.rl import validate_rl_command

        validate_rl_command(json_out, runs)
    return bool(chosen)


def _validate_inference(json_out: bool, heldout: bool, runs: Path | None, other: bool) -> None:
    """``validate --inference``: every published serving row (``--heldout``: the held-out
    ones), or the rows of ``--runs`` (a TOML of ``[[row]]`` tables)."""
    from aihpc.perf.infer.validate import MAPE_TARGET, MAX_TARGET, validate_inference

    if other:
        raise SpecError("--inference", True, "not with --moe, --vlm or --calibration")
    if runs is not None and not os.path.exists(runs):
        raise SpecError("--runs", str(runs), "file not found")
    report = validate_inference(runs, heldout=True if heldout else None)
    if json_out:
        print_json(report.to_json())
        return
    lines = [
        "| row | held out | measured tok/s/GPU | predicted | error |",
        "|---|:---:|---:|---:|---:|",
    ]
    notes = []
    for r in report.rows:
        held = {None: "", 1: "yes"}.get(r.get("heldout_set"), f"yes ({r.get('heldout_set')})")
        mark = "" if r["judged"] else " (not judged)"
        if r.get("uncertainty"):
            notes.append(f"[{len(notes) + 1}] {r['id']}: {r['uncertainty']}")
            mark += f" [{len(notes)}]"
        lines.append(
            f"| {r['id']}{mark} | {held} | {r['measured_per_gpu']:,.0f} | "
            f"{r['predicted_per_gpu']:,.0f} | {r['error']:+.1%} |"
        )
    verdict = "met" if report.passed else "NOT met"
    lines += ["", *notes] if notes else []
    aside = len(report.rows) - len(report.judged)
    lines += [
        "",
        f"{len(report.judged)} rows judged"
        + (f" ({aside} printed, not judged)" if aside else "")
        + f": MAPE {report.mape:.1%}, worst {report.worst:.1%} "
        f"(targets {MAPE_TARGET:.0%} / {MAX_TARGET:.0%}): {verdict}",
    ]
    typer.echo("\n".join(lines))


def _validate_vlm(
    runs: Path | None,
    memory: Path | None,
    heldout: bool,
    moe: bool,
    calibration: Path | None,
    json_out: bool,
) -> None:
    """--vlm: the vision-language set (or a runs CSV of that layout), samples/s/GPU."""
    from aihpc.cli.vlm import print_vlm_validation
    from aihpc.perf.fit.vlm_validate import validate_vlm

    for name, given in (("--memory", memory), ("--calibration", calibration)):
        if given is not None:
            raise SpecError(name, str(given), "not with --vlm (its rows carry their own facts)")
    if heldout or moe:
        flag = "--heldout" if heldout else "--moe"
        raise SpecError(flag, True, "not with --vlm: choose one set of runs")
    if runs is not None and not os.path.exists(runs):
        raise SpecError("--runs", str(runs), "file not found")
    print_vlm_validation(validate_vlm(runs), json_out)


def validation_table(report: ValidationReport) -> str:
    """The validation table as plain Markdown (what docs/performance-model.md quotes)."""
    lines = _row_lines(report) + _source_lines(report) + _memory_lines(report)
    return "\n".join([*lines, "", _verdict_line(report)])


def _plan_text(r: Any) -> str:
    p = r.plan
    return (
        f"tp{p.tp} pp{p.pp} v{p.vpp} cp{p.cp} dp{p.dp}"
        + (f" ep{p.ep}" if p.ep > 1 else "")
        + (f" etp{p.etp}" if p.etp > 1 else "")
        + (f" a2a:{p.moe_a2a_overlap}" if p.moe_a2a_overlap != "none" else "")
        + f" z{p.zero_stage} {p.recompute}"
        + "".join("+" + m for m in p.recompute_modules)
        + f"{f' off{p.offload_layers}' if p.offload_layers else ''} "
        f"mbs{p.micro_batch_size}{' *' if r.searched else ''}"
    )


def _row_lines(report: ValidationReport) -> list[str]:
    lines = [
        "| id | model | GPUs | plan (searched = *) | measured tok/s/GPU | predicted | error |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    for r in report.rows:
        lines.append(
            f"| {r.id} | {r.model} | {r.num_gpus} | {_plan_text(r)} | {r.measured:,.1f} | "
            f"{r.predicted:,.1f} | {r.error:+.1%} |"
        )
    return lines


def _source_lines(report: ValidationReport) -> list[str]:
    from aihpc.perf.fit.validate import source_key

    lines = ["", "| source | rows | MAPE |", "|---|---:|---:|"]
    counts: dict[str, int] = {}
    for r in report.rows:
        counts[source_key(r.source)] = counts.get(source_key(r.source), 0) + 1
    for src, mape in report.mape_by_source().items():
        lines.append(f"| {src} | {counts[src]} | {mape:.1%} |")
    lines.append(
        f"| **overall** | {len(report.rows)} | **{report.mape:.1%}** (max {report.max_error:.1%}) |"
    )
    return lines


def _memory_lines(report: ValidationReport) -> list[str]:
    from aihpc.perf.fit.validate import memory_kind

    if not report.memory:
        return []
    lines = [
        "",
        "| id | component | measured GiB | predicted GiB | error |",
        "|---|---|---:|---:|---:|",
    ]
    for m in report.memory:
        lines.append(
            f"| {m.id} | {m.component}{'' if report.user else f' ({memory_kind(m)})'} | "
            f"{m.measured_gib:.1f} | "
            f"{m.predicted_gib:.1f} | {m.error:+.1%} |"
        )
    return lines


def _verdict_line(report: ValidationReport) -> str:
    """Which targets hold (the MoE set's, the shared set's), or the error of other rows."""
    from aihpc.perf.fit.validate import (
        TARGET_KORTHIKANTI,
        TARGET_MAPE,
        TARGET_MAX_ERROR,
        TARGET_MOE_MAPE,
        TARGET_MOE_MAX_ERROR,
        TARGET_TORCHTITAN,
    )

    met = report.targets_met
    if report.moe:
        over = [r.id for r in report.rows if abs(r.error) > TARGET_MOE_MAX_ERROR]
        return (
            f"MoE targets (issue 17) {'all met' if report.passed else 'NOT all met'}: "
            f"MAPE {report.mape:.1%} ≤ {TARGET_MOE_MAPE:.0%} "
            f"{'met' if met['mape'] else 'NOT met'}; "
            f"worst row {report.max_error:.1%} ≤ {TARGET_MOE_MAX_ERROR:.0%}"
            + (f" ({len(over)} over: {', '.join(over)})" if over else "")
            + f" {'met' if met['max_abs_error'] else 'NOT met'}."
        )
    if report.user:
        return (
            f"Your runs: MAPE {report.mape:.1%}, worst row {report.max_error:.1%} (the "
            "project's targets apply to its published sets only)."
        )
    if report.heldout:
        return (
            f"Held-out rows, outside the shared set the model was developed on (the targets of "
            f"issue #2 apply to the shared set): MAPE {report.mape:.1%}, worst row "
            f"{report.max_error:.1%}."
        )
    over = [r.id for r in report.rows if abs(r.error) > TARGET_MAX_ERROR]
    ko, tt = report.memory_max_error("korthikanti"), report.memory_max_error("torchtitan")
    checks = [
        (f"MAPE {report.mape:.1%} ≤ {TARGET_MAPE:.0%}", met["mape"]),
        (
            f"worst row {report.max_error:.1%} ≤ {TARGET_MAX_ERROR:.0%}"
            + (f" ({len(over)} over: {', '.join(over)})" if over else ""),
            met["max_abs_error"],
        ),
        (f"Korthikanti memory {ko:.2%} ≤ {TARGET_KORTHIKANTI:.0%}", met["korthikanti_memory"]),
        (f"torchtitan memory {tt:.2%} ≤ {TARGET_TORCHTITAN:.0%}", met["torchtitan_memory"]),
    ]
    verdict = "all met" if report.passed else "NOT all met"
    detail = "; ".join(f"{text} {'met' if ok else 'NOT met'}" for text, ok in checks)
    return f"Targets {verdict}: {detail}."
