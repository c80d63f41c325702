"""``aihpc goodput``: time-to-train under failures, checkpoints and restarts."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

import typer

from aihpc.cli import _common
from aihpc.cli._common import RUNSPEC_HELP, guarded, print_json
from aihpc.runspec import SpecError, load_runspec

__all__ = ["parse_count", "register"]

_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
# the table's names for the parts of the lost time (the JSON keeps the keys)
LOST_LABELS = {
    "checkpoint": "checkpoint stalls",
    "lost_work": "work redone after a failure",
    "recovery": "recovery",
    "planned": "planned maintenance",
}


def parse_count(field: str, text: str | None) -> float | None:
    """'15.6T', '1.56e13', '500B' → a number; anything else is a SpecError."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", text)
    if not m:
        raise SpecError(field, text, "expected a number > 0, e.g. 15.6T or 1.56e13")
    value = float(m.group(1)) * _SUFFIX[m.group(2).lower()]
    if not value > 0 or not math.isfinite(value):
        raise SpecError(field, text, "must be a finite number > 0")
    return value


def _step_time_s(spec, step_time: float | None) -> float:  # type: ignore[no-untyped-def]
    if step_time is not None:
        return step_time
    try:
        from aihpc.perf.step.estimate import estimate
    except ImportError as err:  # the performance model is not installed in this build
        raise SpecError("--step-time", None, "required: seconds per optimizer step") from err
    return estimate(spec).step_time_s


def _fmt_s(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "∞"
    if seconds >= 7200:
        return f"{seconds / 3600:.2f} h"
    if seconds >= 120:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.3g} s"


def _count(n: float) -> str:
    """15.6T, 500B, 2.1M: a token count as people write it."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:,.3g}{suffix}"
    return f"{n:,.0f}"


def _render(rep) -> None:  # type: ignore[no-untyped-def]
    from rich.markup import escape
    from rich.table import Table

    d = rep.to_json()
    ck, rc = d["checkpoint"], d["recovery"]
    t = Table(
        title=f"goodput: {rep.num_gpus:,} GPUs, {ck['strategy']} checkpoints",
        show_header=True,
        header_style="bold",
    )
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_column("note")
    t.add_row("job MTBF (unexpected)", _fmt_s(d["mtbf_s"]), escape(d["failure_rate_source"]))
    t.add_row(
        "interruptions / day",
        f"{rep.interruptions_per_day:.2f}",
        f"incl. {d['planned_interruptions_per_day']:.2f} planned",
    )
    t.add_row(
        "expected interruptions",
        f"{d['expected_interruptions']:,.0f}",
        f"over {d['days']:,.3g} days",
    )
    t.add_row("checkpoint size", f"{ck['bytes'] / 1e12:.2f} TB", "weights + fp32 master + moments")
    t.add_row(
        "storage write bandwidth", f"{ck['write_bw_GBps']:,.0f} GB/s", escape(ck["bw_source"])
    )
    t.add_row(
        "save: blocking / persist",
        f"{_fmt_s(ck['blocking_s'])} / {_fmt_s(ck['persist_s'])}",
        "persist runs in the background" if ck["persist_s"] else "",
    )
    t.add_row(
        "recovery",
        _fmt_s(rc["total_s"]),
        f"detect {_fmt_s(rc['detection_s'])} + restart {_fmt_s(rc['restart_s'])} "
        f"+ load {_fmt_s(rc['load_s'])}",
    )
    steps = d["checkpoint_interval_steps"]
    t.add_row(
        "optimal interval",
        _fmt_s(d["optimal_checkpoint_interval_s"]),
        f"Young {_fmt_s(d['young_interval_s'])}, Daly {_fmt_s(d['daly_interval_s'])}; "
        f"used {_fmt_s(d['checkpoint_interval_s'])}"
        + (f" = {steps} steps" if steps is not None else ""),
    )
    t.add_row("ETTR", f"{d['ettr']:.1%}", "useful training time / wall-clock time")
    for key, frac in d["lost_time_fraction"].items():
        t.add_row(f"  lost: {LOST_LABELS.get(key, key)}", f"{frac:.1%}", "")
    t.add_row(
        "tokens/s per GPU",
        f"{d['tokens_per_s_per_gpu']:,.0f}",
        f"x ETTR = {d['goodput_tokens_per_s_per_gpu']:,.0f} (goodput)",
    )
    if "time_to_train_days" in d:
        t.add_row(
            "time to train",
            f"{d['time_to_train_days']:,.1f} days",
            f"{_count(d['tokens'])} tokens, {d['gpu_hours'] / 1e6:,.2f} M GPU-hours",
        )
    _common.console.print(t)
    _common.console.print(escape(rep.summary()))


def _compare(
    runspec: Path, gpus: str | None, measured: Path | None, corr: float | None, as_json: bool
) -> None:
    """--strategy compare: every recovery strategy at every GPU count."""
    from aihpc.cli.goodput_compare import (
        compare_json,
        parse_gpu_counts,
        read_measured,
        render_compare,
    )
    from aihpc.goodput.strategies import DEFAULT_GPU_COUNTS, compare_strategies

    counts = parse_gpu_counts(gpus) or DEFAULT_GPU_COUNTS
    if corr is not None and not (0.0 <= corr <= 1.0):
        raise SpecError("--correlated-loss", corr, "must be a fraction in [0, 1]")
    facts = read_measured(measured)
    spec = load_runspec(runspec)
    out = compare_json(compare_strategies(spec, counts, facts, corr), measured, corr)
    if as_json:
        print_json(out)
    else:
        render_compare(out)


def register(app: typer.Typer) -> None:
    @app.command("goodput")
    @guarded
    def goodput_cmd(
        runspec: Path = typer.Argument(..., help=RUNSPEC_HELP),
        days: float | None = typer.Option(
            None,
            "--days",
            help="Horizon for expected_interruptions (default 30, or the time to train --tokens).",
        ),
        tokens: str | None = typer.Option(
            None, "--tokens", help="Token budget, e.g. 15.6T: adds time_to_train_days."
        ),
        step_time: float | None = typer.Option(
            None, "--step-time", help="Seconds per optimizer step (default: aihpc estimate)."
        ),
        strategy: str | None = typer.Option(
            None,
            "--strategy",
            help="Checkpoint strategy: sync | async | in_memory "
            r"(overrides \[reliability] checkpoint_strategy), or compare: storage-only, async, "
            "in-memory peer and in-process restart side by side at --gpus.",
        ),
        gpus: str | None = typer.Option(
            None, "--gpus", help="With --strategy compare: GPU counts (default 16384,100000)."
        ),
        measured: Path | None = typer.Option(
            None,
            "--measured",
            help="With --strategy compare: a recovery_time.json whose measured detection and "
            "restart times replace the published ones.",
        ),
        correlated_loss: float | None = typer.Option(
            None,
            "--correlated-loss",
            help="With --strategy compare: fraction of node losses that also lose the peer "
            "holding the replica (default 0; independent losses are added).",
        ),
        plot: Path | None = typer.Option(
            None,
            "--plot",
            help="Write goodput against GPU count for several checkpoint strategies to this .png.",
        ),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    ) -> None:
        """Goodput at scale: MTBF, optimal checkpoint interval, ETTR and time-to-train."""
        from aihpc.goodput.plot import _check_plot_path

        if days is not None and not (math.isfinite(days) and days > 0):
            raise SpecError("--days", days, "must be a number of days > 0")
        if step_time is not None and not (math.isfinite(step_time) and step_time > 0):
            raise SpecError("--step-time", step_time, "must be seconds > 0")
        n_tokens = parse_count("--tokens", tokens)
        if plot is not None:
            _check_plot_path(plot)  # fail before the (slower) estimate
        if strategy == "compare":
            if any(v is not None for v in (plot, tokens, days, step_time)):
                raise SpecError(
                    "--strategy", strategy, "compare takes no --plot, --tokens, --days, --step-time"
                )
            _compare(runspec, gpus, measured, correlated_loss, as_json)
            return
        only_compare = {
            "--gpus": gpus,
            "--measured": measured,
            "--correlated-loss": correlated_loss,
        }
        for flag, value in only_compare.items():
            if value is not None:
                raise SpecError(flag, value, "only with --strategy compare")
        _one_strategy(runspec, strategy, step_time, days, n_tokens, plot, as_json)


def _one_strategy(
    runspec: Path,
    strategy: str | None,
    step_time: float | None,
    days: float | None,
    n_tokens: float | None,
    plot: Path | None,
    as_json: bool,
) -> None:
    """The goodput report of the spec's checkpoint strategy (or --strategy's), and its plot."""
    from aihpc.goodput.ettr import goodput_report
    from aihpc.goodput.plot import plot_goodput

    spec = load_runspec(runspec)
    if strategy is not None:
        from aihpc.runspec.reliability import CHECKPOINT_STRATEGIES

        if strategy not in CHECKPOINT_STRATEGIES:
            allowed = " | ".join((*CHECKPOINT_STRATEGIES, "compare"))
            raise SpecError("--strategy", strategy, f"allowed: {allowed}")
        spec = replace(spec, reliability=replace(spec.reliability, checkpoint_strategy=strategy))
    rep = goodput_report(spec, _step_time_s(spec, step_time), days=days, tokens=n_tokens)
    if plot is not None:
        plot_goodput(spec, plot)
    if as_json:
        out = rep.to_json()
        if plot is not None:
            out["plot"] = str(plot)
        print_json(out)
    else:
        _render(rep)
        if plot is not None:
            _common.console.print(f"plot written to {plot}")
