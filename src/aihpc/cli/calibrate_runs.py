"""``aihpc calibrate --runs``: fit the model's efficiency constants to measured runs and write
them as a calibration TOML. Parse, call aihpc.perf.fit.runs_fit, render."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import typer
from rich import box
from rich.table import Table

from aihpc._io import write_atomic
from aihpc.cli._common import console, err_console, print_json
from aihpc.runspec.errors import SpecError

__all__ = ["FIT_OPTION", "RUNS_CHECK_OPTION", "RUNS_OPTION", "calibrate_runs"]

RUNS_OPTION = typer.Option(
    None,
    "--runs",
    help="Instead of INPUTS: fit the model's efficiency constants to measured training runs in "
    "this CSV (columns: aihpc validate --runs-template).",
)
FIT_OPTION = typer.Option(
    None,
    "--fit",
    help="With --runs: the constants to fit, a comma list of gemm, attention, scale_up, "
    "scale_out (default: all that the runs exercise).",
)
RUNS_CHECK_OPTION = typer.Option(
    None,
    "--check",
    help="With --runs: a runs CSV the fit does not see, reported with and without it.",
)

HEADER = (
    "Written by `aihpc calibrate --runs`: multipliers on the model's efficiencies, fitted to "
    'measured runs.\nA run spec names this file with [cluster] calibration = "FILE"; '
    "aihpc estimate shows the terms it changed."
)


def calibrate_runs(
    runs: Path | None,
    fit: str | None,
    check: Path | None,
    output: str,
    as_json: bool,
    others: bool = False,
) -> None:
    """Fit, write ``output``, then report the three errors (and the check set's, if given).
    ``others``: the command also got INPUTS, --local or --spec, which --runs does not take."""
    from aihpc.perf.fit.runs_fit import fit_runs, load_runs, parse_fit_names
    from aihpc.runspec.calibration import calibration_to_toml

    if runs is None:
        flag = "--fit" if fit is not None else "--check"
        raise SpecError(flag, fit or str(check), "only with --runs")
    if others:
        raise SpecError("--runs", str(runs), "not with INPUTS, --local or --spec")
    names = parse_fit_names(fit)
    for flag, path in (("--runs", runs), ("--check", check)):
        if path is not None and not os.path.exists(path):  # False, not OSError, for any name
            raise SpecError(flag, str(path), "file not found")
    with _status("completing the runs' plans", as_json):
        cases = load_runs(runs)
        held = load_runs(check) if check is not None else None
    with _status(f"fitting {len(cases)} runs, and each run left out", as_json):
        result = fit_runs(cases, names)
    cal = result.calibration(f"aihpc calibrate --runs {runs.name} ({len(cases)} runs)")
    checked = result.check(held) if held is not None else None
    warnings = out_of_sample_warnings(result, checked)
    # Written all the same: the user asked for it, the file records its errors, and --check
    # or more runs may yet show it useful; the warning says loudly what it is worth, and the
    # file's header carries the warning to whoever names it in a run spec.
    header = "\n".join([HEADER, *(f"WARNING: {w}" for w in warnings)])
    write_atomic(Path(output), calibration_to_toml(cal, header))
    if as_json:
        print_json({"output": output, **result.to_json(), "check": checked, "warnings": warnings})
    else:
        _render(result, checked, output)
    for w in warnings:  # last, after the table: what the user reads before using the file
        err_console.print(f"[bold yellow]warning:[/] {w}", highlight=False, soft_wrap=True)


def out_of_sample_warnings(result: Any, checked: dict[str, Any] | None) -> list[str]:
    """What the fit is worth on runs it did not see, where that is no better than the default
    constants: its leave-one-out error (each run priced by a fit to the others), and the
    --check set's error. (A fit of no constant, none exercised, is the defaults themselves.)"""
    out = []
    if result.names and not result.beats_default:
        n, runs = len(result.names), len(result.cases)
        follow = (
            f"{n} multipliers on {runs} runs follow"
            if n != 1
            else f"1 multiplier on {runs} runs follows"
        )
        fewer = (
            f"fit fewer constants (--fit {max(result.names, key=result.sensitivity.get)}) or "
            "give more runs"
            if n > 1
            else "give more runs, or leave it out of the run spec"
        )
        out.append(
            f"the fit does not beat the default constants out of sample: leave-one-out MAPE "
            f"{result.loo_mape:.1%} against {result.default_mape:.1%} at the defaults on these "
            f"{runs} runs (fitted {result.fitted_mape:.1%}: {follow} their scatter). A run "
            f"spec naming this calibration is likely priced worse than with none; {fewer}."
        )
    if checked is not None and not checked["calibrated_mape"] < checked["default_mape"]:
        out.append(
            f"on the --check runs the calibration is no better than the default constants: "
            f"MAPE {checked['calibrated_mape']:.1%} with it, {checked['default_mape']:.1%} "
            "without."
        )
    return out


def _status(text: str, quiet: bool) -> AbstractContextManager[Any]:
    """A spinner on stderr, for a person at a terminal only."""
    if quiet or not err_console.is_terminal:
        return nullcontext()
    return err_console.status(text)


def _render(result: Any, checked: dict[str, Any] | None, output: str) -> None:
    t = Table(title=f"{output}: efficiency multipliers", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("constant", "multiplier", "sensitivity", ""):
        t.add_column(col, justify="left" if col in ("constant", "") else "right")
    for name, scale in result.scales.items():
        note = "not exercised by these runs" if name in result.not_exercised else ""
        if name in result.at_bound:
            note = "at its bound: the runs want more"
        if name not in result.names and name not in result.not_exercised:
            note = "not fitted (--fit)"
        sens = result.sensitivity.get(name)
        t.add_row(name, f"{scale:.3f}", "" if sens is None else f"{sens:.3f}", note)
    console.print(t)
    rows = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("run", "measured tok/s/GPU", "default", "fitted", "leave-one-out"):
        rows.add_column(col, justify="left" if col == "run" else "right")
    for r in result.to_json()["rows"]:
        rows.add_row(
            r["id"] + (" *" if r["searched"] else ""),
            f"{r['measured_tokens_per_s_per_gpu']:,.1f}",
            f"{r['default_error']:+.1%}",
            f"{r['fitted_error']:+.1%}",
            f"{r['loo_error']:+.1%}",
        )
    console.print(rows)
    console.print(
        f"MAPE on {len(result.cases)} runs: {result.default_mape:.1%} at the default constants, "
        f"[bold]{result.fitted_mape:.1%}[/] fitted, [bold]{result.loo_mape:.1%}[/] "
        "leave-one-out (each run by a fit to the others)",
        highlight=False,
    )
    if checked is not None:
        console.print(
            f"check set, {checked['num_runs']} runs the fit never saw: MAPE "
            f"{checked['default_mape']:.1%} at the default constants, "
            f"{checked['calibrated_mape']:.1%} with this calibration",
            highlight=False,
        )
    if any(r.searched for r in result.cases):
        console.print("* plan cells left empty: completed by the search, then held fixed")
    console.print(
        f'wrote {output}: name it in a run spec, \\[cluster] calibration = "{output}"',
        highlight=False,
    )
