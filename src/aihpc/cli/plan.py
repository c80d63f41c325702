"""Planning commands: estimate and search (validate is in validate.py, the estimate's text in
_estimate_view.py). Parse, call aihpc.perf, render.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from aihpc._io import check_output_path
from aihpc.cli import _common
from aihpc.cli._common import RUNSPEC_HELP, guarded, print_json
from aihpc.cli._estimate_view import plan_line, render_estimate, yes_no
from aihpc.cli._plan_views import (
    goodput_columns,
    warn_calibration,
    write_plan,
)
from aihpc.cli.goodput import parse_count
from aihpc.runspec import RunSpec, SpecError, load_runspec

__all__ = ["register", "with_headroom"]


if TYPE_CHECKING:  # the planner modules and rich load lazily, inside the commands
    from rich.table import Table

    from aihpc.perf.step.estimate import Estimate


def _goodput_json(spec: RunSpec, step_time_s: float) -> dict[str, Any]:
    from aihpc.goodput.ettr import goodput_report

    return goodput_report(spec, step_time_s).to_json()


HEADROOM = typer.Option(
    None,
    "--headroom-gib",
    help="GiB per GPU a plan must leave free (default: [cluster] memory_headroom_gib, else 0).",
)


def _kept(spec: RunSpec) -> str:
    kept = spec.cluster.memory_headroom_gib
    return f" ({kept:g} GiB of each GPU kept free)" if kept else ""


def with_headroom(spec: RunSpec, headroom_gib: float | None) -> RunSpec:
    """``spec`` keeping ``headroom_gib`` of each GPU free (None: as the spec says)."""
    if headroom_gib is None:
        return spec
    hbm = spec.cluster.gpu.hbm_gib
    if not 0 <= headroom_gib < hbm:
        raise SpecError("--headroom-gib", headroom_gib, f"GiB >= 0 and below the GPU's {hbm:g}")
    cluster = dataclasses.replace(spec.cluster, memory_headroom_gib=headroom_gib)
    return dataclasses.replace(spec, cluster=cluster)


def register(app: typer.Typer) -> None:
    _register_estimate(app)
    _register_search(app)


def _register_estimate(app: typer.Typer) -> None:
    @app.command()
    @guarded
    def estimate(
        runspec: Path = typer.Argument(..., help=RUNSPEC_HELP),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
        goodput: bool = typer.Option(
            True, help="Include the goodput figures (failures, checkpoints, restarts)."
        ),
        headroom: float | None = HEADROOM,
    ) -> None:
        """Estimate memory, step time, MFU and tokens/s of the run spec's plan.

        Exits 1 (after printing the estimate) when the plan does not fit in memory.
        """
        from aihpc.perf.fit.calibration_use import calibration_use
        from aihpc.perf.step.estimate import estimate as run_estimate

        spec = with_headroom(load_runspec(runspec), headroom)
        if spec.vision is not None:  # a vision-language model: the encoder's terms beside
            from aihpc.cli.vlm import vlm_estimate

            vlm_estimate(spec, json_out)
            return
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


SEARCH_FOR = typer.Option(
    None,
    "--for",
    help="megatron | torchtitan | deepspeed: only the plans that framework runs "
    "(the rules its export refuses plans by).",
)
SEARCH_RUNNABLE = typer.Option(
    False,
    "--runnable",
    help="Only the plans `aihpc train` runs (without it each plan is marked).",
)


def _write_best(
    spec: Any, result: Any, output: Path, rank_by: str, framework: str | None, refusal: Any
) -> None:
    """``search -o``: the best plan as a run spec, unless `aihpc train` refuses it and no
    ``--for`` names the framework it is for."""
    if framework is None and refusal is not None:
        raise SpecError(
            "--output",
            str(output),
            f"the best plan is one `aihpc train` refuses ({refusal}); add --runnable to "
            "write the best plan it runs, or --for FRAMEWORK to write one for that framework",
        )
    how = "goodput (throughput x ETTR)" if rank_by == "goodput" else "tokens/s/GPU"
    write_plan(
        spec,
        result.plans[0],
        output,
        f"the best of {result.feasible:,} plans that fit, ranked by {how}: "
        f"{result.plans[0].tokens_per_s_per_gpu:,.1f} tokens/s/GPU",
    )


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
        headroom: float | None = HEADROOM,
        framework: str | None = SEARCH_FOR,
        runnable: bool = SEARCH_RUNNABLE,
    ) -> None:
        r"""Search every valid plan; \[parallel] fields given in the run spec stay fixed.

        Each plan is marked with whether `aihpc train` runs it (and why not); `-o` writes only
        a plan it runs, unless --for names the framework the plan is for."""
        if rank_by not in ("throughput", "goodput"):
            raise SpecError("--rank-by", rank_by, "allowed: throughput | goodput")
        n_tokens = parse_count("--tokens", tokens)
        if output is not None:
            check_output_path(output, "--output", ".toml")
        spec = with_headroom(load_runspec(runspec), headroom)
        if spec.vision is not None:  # plans x encoder placements (perf/multimodal/search.py)
            from aihpc.cli.vlm import refuse_vlm_flags, vlm_search

            flags = {"--explain": explain, "--rank-by": rank_by != "throughput"}
            flags |= {"--tokens": tokens, "--output": output, "--for": framework}
            refuse_vlm_flags(flags)
            vlm_search(spec, top, json_out, runnable)
            return
        accept = None
        if framework is not None:
            from aihpc.cli._frameworks import plan_rules

            accept = plan_rules(framework, spec)
        result = _run_search(
            spec, top, rank_by, explain, quiet=json_out, accept=accept, runnable=runnable
        )
        shown = result.plans[:top]
        refusals = _trainer_refusals(spec, shown)
        cols, extra = (
            goodput_columns(spec, shown, n_tokens)
            if rank_by == "goodput" or n_tokens is not None
            else ([], [{} for _ in shown])
        )
        if output is not None:
            _write_best(spec, result, output, rank_by, framework, refusals[0])
        if json_out:
            _search_json(result, top, extra, output, explain, refusals)
            return
        _common.console.print(
            f"{spec.model.name} on {spec.cluster.num_gpus} × {spec.cluster.gpu.id}: "
            f"{result.evaluated:,} valid plans{' aihpc train runs' if runnable else ''} evaluated, "
            f"{result.feasible:,} fit{_kept(spec)}, "
            f"{result.elapsed_s:.2f} s"
        )
        _common.console.print(_search_table(spec, shown, cols, refusals))
        _trainer_notes(refusals)
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


def _trainer_refusals(spec: RunSpec, plans: list[Estimate]) -> list[SpecError | None]:
    """What `aihpc train` says to each plan: None where it runs it, else its refusal
    (aihpc.runspec.rules, the rules the trainer checks before it starts)."""
    from aihpc.runspec.rules import trainer_plan_rule

    rule = trainer_plan_rule(spec.model, spec.training, spec.cluster.num_gpus)
    return [rule(e.plan) for e in plans]


def _trainer_notes(refusals: list[SpecError | None]) -> None:
    """One line per reason the trainer refuses some of the plans listed, naming them by #."""
    by_reason: dict[str, list[str]] = {}
    for i, err in enumerate(refusals, 1):
        if err is not None:
            by_reason.setdefault(str(err), []).append(f"#{i}")
    for reason, rows in by_reason.items():
        _common.console.print(
            f"aihpc train refuses {', '.join(rows)}: {reason} (--runnable: only the plans it runs)",
            highlight=False,
        )


def _run_search(
    spec: RunSpec,
    top: int,
    rank_by: str,
    explain: bool,
    quiet: bool,
    accept: Any = None,
    runnable: bool = False,
) -> Any:
    """The search with a progress bar on a terminal; a search with nothing valid, or nothing
    that fits, is one line naming the rule or the memory it needs."""
    from aihpc.perf.search.ranking import search as run_search

    weight = None
    if rank_by == "goodput":  # throughput x ETTR, ETTR a function of the step time alone
        from aihpc.goodput.ettr import ettr_of_step_time

        weight = ettr_of_step_time(spec)
    with _search_bar(quiet) as progress:
        result = run_search(
            spec,
            top=top,
            weight=weight,
            explain=5 if explain else 0,
            progress=progress,
            accept=accept,
            runnable=runnable,
        )
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
            f"no plan fits in {spec.cluster.usable_hbm_gib:.0f} GiB per GPU{_kept(spec)}"
            f"{hint}; add GPUs or use a part with more memory",
        )
    return result


def _search_json(
    result: Any,
    top: int,
    extra: list[dict],
    output: Path | None,
    explain: bool,
    refusals: list[SpecError | None],
) -> None:
    out = result.to_json(top)
    for j, x, err in zip(out["plans"], extra, refusals, strict=True):
        j.update(x)
        j["runnable"] = err is None
        j["trainer_refuses"] = None if err is None else str(err)
    if output is not None:
        out["output"] = str(output)
    if explain:
        out["rejected"] = [
            {**r.estimate.to_json(), "reason": r.reason} for r in result.rejected_best
        ]
        out["invalid_reasons"] = dict(result.invalid_reasons)
    print_json(out)


def _search_table(
    spec: RunSpec, plans: list[Estimate], cols: list, refusals: list[SpecError | None]
) -> Table:
    """The ranked plans, one row each, with the goodput / time-to-train columns when asked, and
    whether `aihpc train` runs each (``train``: yes, or no with the reason below the table)."""
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
        "train",
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
            yes_no(p.sequence_parallel),
            p.recompute + (f" +offload {p.offload_layers}" if p.offload_layers else ""),
            str(p.micro_batch_size),
            f"{e.tokens_per_s_per_gpu:,.1f}",
            f"{e.mfu:.1%}",
            f"{e.memory.total / 2**30:.1f}",
            "yes" if refusals[i - 1] is None else "no",
            *(values[i - 1] for _, values in cols),
        )
    return t


def _explain_search(result: Any) -> None:
    if result.rejected_best:
        _common.console.print("[bold]Faster-looking plans that were rejected:[/]")
        for r in result.rejected_best:
            _common.console.print(
                f"  {plan_line(r.estimate.plan.as_dict())}: "
                f"{r.estimate.tokens_per_s_per_gpu:,.1f} tok/s/GPU — {r.reason}"
            )
    else:
        _common.console.print("No rejected plan would have been faster than the best one.")
    if result.invalid_reasons:
        reasons = ", ".join(f"{k} ({v})" for k, v in result.invalid_reasons.most_common())
        _common.console.print(f"Combinations skipped by divisibility rules: {reasons}")
