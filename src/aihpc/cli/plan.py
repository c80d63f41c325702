"""Planning commands: estimate and search (validate is in validate.py). Parse, call aihpc.perf,
render."""

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
from aihpc.runspec import RunSpec, SpecError, load_runspec

if TYPE_CHECKING:  # the planner modules and rich load lazily, inside the commands
    from rich.table import Table

    from aihpc.perf.fit.calibration_use import CalibrationUse
    from aihpc.perf.step.estimate import Estimate

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
    from aihpc.goodput.ettr import goodput_report

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
        from aihpc.perf.fit.calibration_use import calibration_use
        from aihpc.perf.step.estimate import estimate as run_estimate

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
    from aihpc.perf.search.ranking import search as run_search

    key = None
    if rank_by == "goodput":
        from aihpc.goodput.ettr import ettr_of_step_time

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
