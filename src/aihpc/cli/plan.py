"""Planning commands: estimate, search, validate. Parse, call aihpc.perf, render."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from aihpc._io import check_output_path
from aihpc.cli import _common
from aihpc.cli._common import RUNSPEC_HELP, guarded, print_json
from aihpc.cli._plan_views import (
    goodput_columns,
    render_calibration,
    warn_calibration,
    write_plan,
)
from aihpc.cli.goodput import parse_count
from aihpc.spec import RunSpec, SpecError, load_runspec

if TYPE_CHECKING:  # the planner modules and rich load lazily, inside the commands
    from rich.table import Table

    from aihpc.perf.calibration_use import CalibrationUse
    from aihpc.perf.estimate import Estimate
    from aihpc.perf.validate import ValidationReport

__all__ = ["register"]

TIME_LABELS = {
    "compute": "compute (forward + backward)",
    "recompute": "activation recompute",
    "tp_comm": "tensor-parallel comm (exposed)",
    "cp_comm": "context-parallel comm (exposed)",
    "ep_comm": "expert-parallel all-to-all (exposed)",
    "pp_comm": "pipeline p2p (exposed)",
    "dp_comm": "data-parallel comm (exposed)",
    "pipeline_bubble": "pipeline bubble",
    "optimizer": "optimizer step",
    "offload": "activation offload copies (exposed)",
}


def _goodput_json(spec: RunSpec, step_time_s: float) -> dict[str, Any]:
    from aihpc.perf.goodput import goodput_report

    return goodput_report(spec, step_time_s).to_json()


def _yes_no(flag: bool) -> str:
    """How every table and plan line shows an on/off plan field (sequence parallelism)."""
    return "y" if flag else "n"


def _plan_line(plan: dict) -> str:
    return (
        f"tp {plan['tp']} · pp {plan['pp']} · vpp {plan['vpp']} · cp {plan['cp']} · "
        f"dp {plan['dp']}"
        + (f" · ep {plan['ep']}" if plan.get("ep", 1) > 1 else "")
        + (f" · etp {plan['etp']}" if plan.get("etp", 1) > 1 else "")
        + (
            f" · a2a overlap {plan['moe_a2a_overlap']}"
            if plan.get("moe_a2a_overlap", "none") != "none"
            else ""
        )
        + f" · zero {plan['zero_stage']} · sp {_yes_no(plan['sequence_parallel'])}"
        f" · recompute {plan['recompute']}"
        + "".join(f"+{m}" for m in plan.get("recompute_modules", ()))
        + f" · mbs {plan['micro_batch_size']} · "
        f"gbs {plan['global_batch_size']}"
        + (f" · offload {plan['offload_layers']} layers" if plan.get("offload_layers") else "")
    )


def _ctas(n: int) -> str:
    return f"{n} CTA" + ("s" if n > 1 else "")


def _software_line(spec: RunSpec, est: Estimate) -> str:
    """The [training] facts the estimate priced, so a reader sees what was assumed."""
    tr = spec.training
    parts = [
        f"attention {tr.attention}",
        f"element-wise {'fused' if tr.fused_kernels else 'eager'}",
        f"cross-entropy {tr.cross_entropy}",
        f"gradients {tr.grad_reduce_dtype}"
        + (" reduced during backward" if tr.grad_reduce_overlap else " reduced after backward"),
        f"optimizer states {tr.optimizer_dtype}",
    ]
    if est.plan.zero_stage == 3:
        parts.append(f"ZeRO-3 gathers {tr.zero3_gather}")
    if est.plan.tp > 1:
        parts.append(f"TP overlap {tr.tp_comm_overlap}")
    if est.plan.cp > 1:
        parts.append(
            f"CP K/V {tr.cp_exchange}"
            + (" (heads repeated)" if tr.kv_repeat else "")
            + (f" on {_ctas(tr.cp_comm_ctas)}" if tr.cp_comm_ctas else "")
        )
    if est.plan.pp > 1:
        parts.append(
            f"pipeline chunks {tr.pipeline_split}"
            + (f", sends on {_ctas(tr.pp_comm_ctas)}" if tr.pp_comm_ctas else "")
        )
    if est.moe and (est.plan.ep > 1 or est.plan.etp > 1):
        parts.append(
            f"MoE dispatch {tr.moe_dispatcher} in {tr.moe_dispatch_dtype}"
            + (f", busiest rank {tr.moe_imbalance:g}x balanced" if tr.moe_imbalance > 1 else "")
            + (", one GEMM launch per expert" if tr.moe_expert_gemm == "per_expert" else "")
        )
    if tr.precision == "fp8":
        parts.append(f"FP8 linear inputs kept in {tr.fp8_saved_inputs}")
        if tr.fp8_param_gather:
            parts.append("parameters gathered in FP8")
    return " · ".join(parts)


def render_estimate(spec: RunSpec, est: Estimate, use: CalibrationUse | None = None) -> None:
    from rich.table import Table

    out = est.to_json()
    m = spec.model
    gbs = out["plan"]["global_batch_size"]
    _common.console.print(
        f"[bold]{m.name}[/] on {spec.cluster.num_gpus} × {spec.cluster.gpu.id} "
        f"({spec.training.precision}) · seq {m.seq_length:,} · "
        f"{gbs * m.seq_length:,} tokens per step ({gbs:,} sequences)"
    )
    _common.console.print(f"plan: {_plan_line(out['plan'])}")
    # pp_schedule follows vpp and dp_shard follows dp (full sharding): derived; recompute_modules
    # is not searched; the expert fields mean nothing for a dense model
    skip = {"pp_schedule", "dp_shard", "recompute_modules"}
    if not m.is_moe:
        skip |= {"ep", "etp", "moe_a2a_overlap"}
    given = spec.parallel.given()
    defaulted = [k for k in out["plan"] if k not in given and k not in skip]
    if defaulted:
        _common.console.print(
            f"[dim]defaults used for: {', '.join(defaulted)} "
            "(`aihpc search` chooses them instead)[/]"
        )
    _common.console.print(f"[dim]software: {_software_line(spec, est)} (set in \\[training])[/]")
    render_calibration(use)
    t = Table(title="Step time", show_edge=False)
    t.add_column("part")
    t.add_column("seconds", justify="right")
    t.add_column("share", justify="right")
    if use is not None:  # which rows the calibration file changed
        t.add_column("calibrated")
    for key, value in out["time_s"].items():
        if value > 0:
            mark = ["yes" if key in use.terms else ""] if use is not None else []
            t.add_row(
                TIME_LABELS.get(key, key), f"{value:.3f}", f"{value / est.step_time_s:.1%}", *mark
            )
    t.add_row("[bold]step[/]", f"[bold]{est.step_time_s:.3f}[/]", "100%")
    _common.console.print(t)
    mt = Table(title=f"Memory per GPU ({est.memory.stage} stage, GiB)", show_edge=False)
    mt.add_column("part")
    mt.add_column("GiB", justify="right")
    for key, value in out["memory_gib"].items():
        if key != "total":
            mt.add_row(key, f"{value:.1f}")
    fit = "[green]fits[/]" if est.fits else "[red]does NOT fit[/]"
    mt.add_row(
        "[bold]total[/]", f"[bold]{est.memory.total / 2**30:.1f}[/] of {est.hbm_gib:.0f} ({fit})"
    )
    if est.memory.offloaded:
        host = f" of {est.host_mem_gib:.0f}" if est.host_mem_gib else ""
        mt.add_row("offloaded to host memory", f"{out['host_offload_gib']:.1f}{host}")
    if out["gradients_after_peak_gib"] >= 0.05:
        # FSDP2 creates gradients in the backward, after the peak: not part of the total
        mt.add_row("gradients made after the peak", f"{out['gradients_after_peak_gib']:.1f}")
    _common.console.print(mt)
    _common.console.print(
        f"tokens/s/GPU [bold]{est.tokens_per_s_per_gpu:,.0f}[/] · model TFLOP/s/GPU "
        f"{est.model_tflops_per_gpu:.0f} · MFU [bold]{est.mfu:.1%}[/] · HFU {est.hfu:.1%}"
    )
    _common.console.print(f"[bold]Bottleneck:[/] {est.bottleneck}")


def register(app: typer.Typer) -> None:
    _register_estimate(app)
    _register_search(app)
    _register_validate(app)


def _register_estimate(app: typer.Typer) -> None:
    @app.command()
    @guarded
    def estimate(
        runspec: Path = typer.Argument(..., help=RUNSPEC_HELP),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
        goodput: bool = typer.Option(
            True, help="Include the goodput figures (failures, checkpoints, restarts)."
        ),
    ) -> None:
        """Estimate memory, step time, MFU and tokens/s of the run spec's plan.

        Exits 1 (after printing the estimate) when the plan does not fit in memory.
        """
        from aihpc.perf.calibration_use import calibration_use
        from aihpc.perf.estimate import estimate as run_estimate

        spec = load_runspec(runspec)
        est = run_estimate(spec)
        use = calibration_use(spec)
        warn_calibration(use)
        if json_out:
            out = est.to_json()
            out["seq_length"] = spec.model.seq_length
            out["tokens_per_step"] = est.plan.global_batch_size * spec.model.seq_length
            out["calibration"] = use.to_json() if use is not None else None
            if goodput:
                out["goodput"] = _goodput_json(spec, est.step_time_s)
            print_json(out)
        else:
            render_estimate(spec, est, use)
            if goodput:
                g = _goodput_json(spec, est.step_time_s)
                _common.console.print(
                    f"goodput: MTBF {g['mtbf_s'] / 3600:.1f} h · ETTR {g['ettr']:.1%} · "
                    f"checkpoint every {g['optimal_checkpoint_interval_s'] / 60:.0f} min"
                )
        if not est.fits:
            raise typer.Exit(1)


def _register_search(app: typer.Typer) -> None:
    @app.command()
    @guarded
    def search(
        runspec: Path = typer.Argument(..., help=RUNSPEC_HELP),
        top: int = typer.Option(10, "--top", min=1, help="How many plans to list."),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
        explain: bool = typer.Option(
            False, "--explain", help="Show why faster-looking plans were rejected."
        ),
        rank_by: str = typer.Option(
            "throughput", "--rank-by", help="throughput (tokens/s/GPU) | goodput (× ETTR)."
        ),
        tokens: str | None = typer.Option(
            None, "--tokens", help="Token budget, e.g. 15T: adds days and GPU-hours to train it."
        ),
        output: Path | None = typer.Option(
            None, "--output", "-o", help="Write the best plan here as a runnable run spec (.toml)."
        ),
    ) -> None:
        r"""Search every valid plan; \[parallel] fields given in the run spec stay fixed."""
        if rank_by not in ("throughput", "goodput"):
            raise SpecError("--rank-by", rank_by, "allowed: throughput | goodput")
        n_tokens = parse_count("--tokens", tokens)
        if output is not None:
            check_output_path(output, "--output", ".toml")
        spec = load_runspec(runspec)
        result = _run_search(spec, top, rank_by, explain, quiet=json_out)
        shown = result.plans[:top]
        cols, extra = (
            goodput_columns(spec, shown, n_tokens)
            if rank_by == "goodput" or n_tokens is not None
            else ([], [{} for _ in shown])
        )
        if output is not None:
            how = "goodput (throughput x ETTR)" if rank_by == "goodput" else "tokens/s/GPU"
            write_plan(
                spec,
                result.plans[0],
                output,
                f"the best of {result.feasible:,} plans that fit, ranked by {how}: "
                f"{result.plans[0].tokens_per_s_per_gpu:,.1f} tokens/s/GPU",
            )
        if json_out:
            _search_json(result, top, extra, output, explain)
            return
        _common.console.print(
            f"{spec.model.name} on {spec.cluster.num_gpus} × {spec.cluster.gpu.id}: "
            f"{result.evaluated:,} valid plans evaluated, {result.feasible:,} fit, "
            f"{result.elapsed_s:.2f} s"
        )
        _common.console.print(_search_table(spec, result.plans[:top], cols))
        _common.console.print(f"[bold]Best plan:[/] {result.plans[0].bottleneck}")
        if output is not None:
            _common.console.print(f"best plan written to {output}", highlight=False)
        if explain:
            _explain_search(result)


@contextmanager
def _search_bar(quiet: bool) -> Iterator[Callable[[int], None] | None]:
    """A transient bar on stderr while the search runs, when stderr is a terminal. With --json
    (quiet) there is none, and rich is not imported for it."""
    if quiet:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("searching plans"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=_common.err_console,
        transient=True,
        disable=not _common.err_console.is_terminal,
    ) as bar:
        task = bar.add_task("search", total=None)
        yield lambda n: bar.update(task, completed=n)


def _run_search(spec: RunSpec, top: int, rank_by: str, explain: bool, quiet: bool) -> Any:
    """The search with a progress bar on a terminal; a search with nothing valid, or nothing
    that fits, is one line naming the rule or the memory it needs."""
    from aihpc.perf.search import search as run_search

    key = None
    if rank_by == "goodput":
        from aihpc.perf.goodput import ettr_of_step_time

        ettr_at = ettr_of_step_time(spec)

        def key(e: Estimate) -> float:
            return e.tokens_per_s_per_gpu * ettr_at(e.step_time_s)

    with _search_bar(quiet) as progress:
        result = run_search(spec, top=top, key=key, explain=5 if explain else 0, progress=progress)
    refusal = result.refusal()
    if refusal is not None:  # no combination is valid: say which rule refused, not "no fit"
        raise refusal
    if not result.plans:
        hint = ""
        if result.rejected_best:
            need = min(r.estimate.memory.total for r in result.rejected_best) / 2**30
            hint = f" (the leanest rejected plan needs {need:.0f} GiB)"
        raise SpecError(
            "cluster.num_gpus",
            spec.cluster.num_gpus,
            f"no plan fits in {spec.cluster.gpu.hbm_gib:.0f} GiB per GPU"
            f"{hint}; add GPUs or use a part with more memory",
        )
    return result


def _search_json(
    result: Any, top: int, extra: list[dict], output: Path | None, explain: bool
) -> None:
    out = result.to_json(top)
    for j, x in zip(out["plans"], extra, strict=True):
        j.update(x)
    if output is not None:
        out["output"] = str(output)
    if explain:
        out["rejected"] = [
            {**r.estimate.to_json(), "reason": r.reason} for r in result.rejected_best
        ]
        out["invalid_reasons"] = dict(result.invalid_reasons)
    print_json(out)


def _search_table(spec: RunSpec, plans: list[Estimate], cols: list) -> Table:
    """The ranked plans, one row each, with the goodput / time-to-train columns when asked."""
    from rich.table import Table

    t = Table(show_edge=False)
    moe_cols = ("ep", "etp", "a2a") if spec.model.is_moe else ()
    for col in (
        "#",
        "tp",
        "pp",
        "vpp",
        "cp",
        "dp",
        *moe_cols,
        "zero",
        "sp",
        "recompute",
        "mbs",
        "tok/s/GPU",
        "MFU",
        "GiB",
        *(c for c, _ in cols),
    ):
        t.add_column(col, justify="left" if col == "recompute" else "right", no_wrap=True)
    for i, e in enumerate(plans, 1):
        p = e.plan
        t.add_row(
            str(i),
            str(p.tp),
            str(p.pp),
            str(p.vpp),
            str(p.cp),
            str(p.dp),
            *((str(p.ep), str(p.etp), p.moe_a2a_overlap) if moe_cols else ()),
            str(p.zero_stage),
            _yes_no(p.sequence_parallel),
            p.recompute + (f" +offload {p.offload_layers}" if p.offload_layers else ""),
            str(p.micro_batch_size),
            f"{e.tokens_per_s_per_gpu:,.1f}",
            f"{e.mfu:.1%}",
            f"{e.memory.total / 2**30:.1f}",
            *(values[i - 1] for _, values in cols),
        )
    return t


def _explain_search(result: Any) -> None:
    if result.rejected_best:
        _common.console.print("[bold]Faster-looking plans that were rejected:[/]")
        for r in result.rejected_best:
            _common.console.print(
                f"  {_plan_line(r.estimate.plan.as_dict())}: "
                f"{r.estimate.tokens_per_s_per_gpu:,.1f} tok/s/GPU — {r.reason}"
            )
    else:
        _common.console.print("No rejected plan would have been faster than the best one.")
    if result.invalid_reasons:
        reasons = ", ".join(f"{k} ({v})" for k, v in result.invalid_reasons.most_common())
        _common.console.print(f"Combinations skipped by divisibility rules: {reasons}")


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
    from aihpc.perf.runs_csv import template_text

    text = template_text()
    if json_out:
        print_json({"columns": text.splitlines()[0].split(","), "csv": text})
    else:
        typer.echo(text, nl=False)


def _register_validate(app: typer.Typer) -> None:
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
    ) -> None:
        """Predicted vs measured tokens/s/GPU and memory on published runs or your own
        (--runs); MAPE per source."""
        from rich.progress import BarColumn, Progress, TextColumn

        from aihpc.perf.validate import validate as run_validate

        if runs_template:
            _print_runs_template(json_out)
            return
        cal = None
        if calibration is not None:
            from aihpc.spec.calibration import load_calibration

            cal = load_calibration(calibration)

        for name, path in (("--runs", runs), ("--memory", memory)):
            if path is not None and not path.is_file():
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
    from aihpc.perf.validate import source_key

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
    from aihpc.perf.validate import memory_kind

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
    from aihpc.perf.validate import (
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
