"""``aihpc calibrate``: fit collective and GEMM measurements (``aihpc bench`` JSON, nccl-tests
logs, or this host measured with --local) into a calibration TOML; with --runs, the model's
efficiency constants to measured training runs (calibrate_runs.py).

torch is imported only by --local, so ``aihpc calibrate`` on an nccl-tests log works on a laptop.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from aihpc._io import check_output_path, write_atomic
from aihpc.cli._common import (
    OLD_OUTPUT,
    console,
    err_console,
    fail,
    guarded,
    print_json,
    renamed_output,
    require_torch,
)
from aihpc.cli.calibrate_runs import FIT_OPTION, RUNS_CHECK_OPTION, RUNS_OPTION, calibrate_runs
from aihpc.runspec.errors import SpecError

__all__ = ["register"]

# above this the fit is reported but flagged (research notes section 1.4 suggest refusing > 15 %)
_WARN_REL_ERROR = 0.15


def _human(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _local_spec_target(spec_path: str | None, local: bool, nproc: int) -> tuple | None:
    """(the spec read, where its local copy goes), checked before anything is measured."""
    if nproc < 1:
        raise SpecError("--nproc", nproc, "must be at least 1")
    if spec_path is None:
        return None
    if not local:
        raise SpecError("--spec", spec_path, "only with --local")
    from aihpc.bench.local import attention_shape
    from aihpc.bench.local_decode import decode_shape
    from aihpc.runspec import load_runspec

    spec = load_runspec(spec_path)  # a bad spec is exit 2 before minutes of measuring
    target = Path(Path(spec_path).stem + ".local.toml")  # in the current folder
    check_output_path(target, "--spec")
    mbs = getattr(spec.parallel, "micro_batch_size", None)
    return spec_path, target, attention_shape(spec.model, mbs), decode_shape(spec.model), spec.model


def _faults_target(model: Any, micro_batch: int) -> tuple[Any, int, float]:
    """What the page-fault phase measures (bench/local_faults.py): the spec's model (without
    one tiny-llama-small; an MoE model's dense twin, whose layers page_faults counts) at
    ``micro_batch`` sequences, and the pages its step's large fresh allocations take."""
    import dataclasses

    from aihpc.bench.local_faults import MICRO_BATCHES
    from aihpc.perf.step.page_faults import step_pages
    from aihpc.runspec.model import model_from_table

    if model is None:
        model = model_from_table({"preset": "tiny-llama-small"})
    dense = dataclasses.replace(model, num_experts=0) if model.num_experts else model
    pages = step_pages(dense, micro_batch * dense.seq_length, MICRO_BATCHES)
    return dense, micro_batch, pages


def _measure_local(nproc: int, target: tuple | None, quiet: bool) -> tuple[list, dict, dict, tuple]:
    """This host's measurements as calibration points (GEMMs for fp32 and, as the CPU
    runtime trains bf16 specs in fp32, for bf16 too), its gpu_spec table, and (a collective's
    cost inside a step, DTensor's host time per op); the attention kernel and the DTensor
    decoder at the shape of ``target``'s model (``_local_spec_target``), else a default one.
    Each phase is a line on stderr unless ``quiet``; a figure no device could give is exit 1."""
    import tempfile
    import time

    from aihpc.bench.calibrate import load_measurements
    from aihpc.bench.local import (
        DEFAULT_ATTENTION_SHAPE,
        MeasurementError,
        local_gpu_spec,
        measure_local,
    )

    shape = target[2] if target else DEFAULT_ATTENTION_SHAPE

    def say(line: str) -> None:
        err_console.print(line, highlight=False, markup=False, soft_wrap=True)

    t0 = time.perf_counter()
    try:
        decode = target[3] if target else None
        faults = _faults_target(target[4] if target else None, shape[0])
        m = measure_local(
            nproc, attention=shape, progress=None if quiet else say, decode=decode,
            faults_target=faults,
        )  # fmt: skip
    except MeasurementError as err:
        fail(str(err), code=1)
    if not quiet:
        say(f"measured in {time.perf_counter() - t0:.0f} s")
    with tempfile.TemporaryDirectory(prefix="aihpc-local-") as tmp:
        files = [Path(tmp) / "gemm.json"]
        files[0].write_text(json.dumps(m.gemm))
        if m.comm:
            files.append(Path(tmp) / "comm.json")
            files[-1].write_text(json.dumps(m.comm))
        comm_pts, gemm_pts = load_measurements([str(f) for f in files], None, None, "out-of-place")
    if "fp32" in gemm_pts:
        gemm_pts.setdefault("bf16", list(gemm_pts["fp32"]))
    return (
        comm_pts,
        gemm_pts,
        local_gpu_spec(m),
        (m.call, m.dtensor_op_us, m.dtensor_optimizer_op_us),
    )


def _write_local_spec(target: tuple, calibration: Path, device: dict, nproc: int) -> None:
    import os
    import tomllib

    from aihpc.runspec.tomlw import dumps_toml

    spec_path, out = target[:2]
    data = tomllib.loads(Path(spec_path).read_text())
    cluster = data.setdefault("cluster", {})
    for key in ("gpu", "gpu_spec", "num_gpus", "gpus_per_node", "scale_up_domain"):
        cluster.pop(key, None)
    cluster.update(
        num_gpus=nproc,
        gpus_per_node=nproc,
        calibration=os.path.relpath(calibration.resolve(), out.resolve().parent),
        gpu_spec=device,
    )
    header = (
        f"{spec_path} on this host as {nproc} rank(s): [cluster] written by "
        "`aihpc calibrate --local`"
    )
    write_atomic(out, dumps_toml(data, header))
    err_console.print(f"wrote {out}: {spec_path} priced on this host", highlight=False)


def register(app: typer.Typer) -> None:
    @app.command("calibrate")
    @guarded
    def calibrate(
        inputs: list[str] = typer.Argument(
            None, help="`aihpc bench comm|gemm --json` outputs and/or nccl-tests text logs."
        ),
        runs: Path | None = RUNS_OPTION,
        fit: str | None = FIT_OPTION,
        check: Path | None = RUNS_CHECK_OPTION,
        output: str = typer.Option(
            "calibration.toml", "-o", "--output", help="Calibration TOML to write."
        ),
        output_old: str | None = OLD_OUTPUT,
        tier: str | None = typer.Option(
            None,
            "--tier",
            help="scale_up | scale_out (default: from the run; one host = scale_up).",
        ),
        collective: str | None = typer.Option(
            None, "--collective", help="For nccl-tests logs that do not name their test."
        ),
        column: str = typer.Option(
            "out-of-place", "--column", help="Which time to fit: out-of-place | in-place | min."
        ),
        regimes: int = typer.Option(3, "--regimes", help="Size regimes per fit (1-4)."),
        local: bool = typer.Option(
            False,
            "--local",
            help="Measure this host instead of reading INPUTS: GEMMs, memory bandwidth and "
            "collectives on --nproc local ranks.",
        ),
        nproc: int = typer.Option(2, "--nproc", help="With --local: ranks the job will run."),
        spec_path: str | None = typer.Option(
            None,
            "--spec",
            help="With --local: also write SPEC's copy for this host here, as STEM.local.toml.",
        ),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    ) -> None:
        r"""Fit latency / bandwidth per collective and tier (and GEMM efficiency) into a TOML
        that a run spec names with \[cluster] calibration = "FILE"; or, with --runs, the
        model's efficiency constants to measured training runs."""
        from aihpc.runspec.calibration import COLLECTIVES

        output = renamed_output(output, output_old)

        if collective is not None and collective not in COLLECTIVES:
            raise SpecError("--collective", collective, "allowed: " + " | ".join(COLLECTIVES))
        if not 1 <= regimes <= 4:
            raise SpecError("--regimes", regimes, "allowed: 1 to 4")
        check_output_path(Path(output), "--output")
        if runs is not None or fit is not None or check is not None:
            others = bool(inputs or local or spec_path)
            calibrate_runs(runs, fit, check, output, as_json, others)
            return
        if local == bool(inputs):
            raise SpecError(
                "INPUTS",
                " ".join(inputs or []) or "none",
                "give measurement files, --local or --runs",
            )
        _calibrate_measurements(
            inputs, tier, collective, column, regimes, output, local, nproc, spec_path, as_json
        )


def _calibrate_measurements(
    inputs: list[str] | None,
    tier: str | None,
    collective: str | None,
    column: str,
    regimes: int,
    output: str,
    local: bool,
    nproc: int,
    spec_path: str | None,
    as_json: bool,
) -> None:
    """Fit collective and GEMM measurements (files, or this host's with --local) into a
    calibration TOML at OUTPUT, and the spec's copy for this host where --spec asks."""
    from aihpc.bench.calibrate import fit_to_calibration, load_measurements
    from aihpc.runspec.calibration import calibration_to_toml

    local_spec = _local_spec_target(spec_path, local, nproc)
    warnings: list[str] = []
    if local:
        require_torch("calibrate --local")
        from aihpc.bench.local import load_warning

        warnings += [w for w in (load_warning(),) if w]
        _warn(warnings)  # before the minutes it explains
        comm_pts, gemm_pts, device, (call, dtensor_op_us, dtensor_opt_us) = _measure_local(
            nproc, local_spec, as_json
        )
        source = f"aihpc calibrate --local --nproc {nproc}"
    else:
        comm_pts, gemm_pts = load_measurements(inputs or [], tier, collective, column)
        device, call, dtensor_op_us, dtensor_opt_us = None, None, None, None
        source = "aihpc calibrate " + " ".join(Path(p).name for p in inputs or [])
    cal, reports = fit_to_calibration(comm_pts, gemm_pts, source, regimes)
    if call is not None:  # a call inside a training step costs what it costs between GEMMs
        from aihpc.bench.local_sync import with_call_cost

        cal = with_call_cost(cal, call)
    if dtensor_op_us is not None:
        cal = replace(cal, dtensor_op_us=dtensor_op_us, dtensor_optimizer_op_us=dtensor_opt_us)
    header = (
        "Written by `aihpc calibrate`. Time of a collective of whole-buffer size S on "
        "n ranks:\nlatency_us + S * busbw_factor(n) / busbw_GBps / 1e3 (us), in the "
        "regime S falls in."
    )
    write_atomic(Path(output), calibration_to_toml(cal, header))
    if local_spec is not None:
        _write_local_spec(local_spec, Path(output), device, nproc)
    fits = _fit_warnings(reports)
    _warn(fits)
    _report_calibration(output, cal, reports, as_json, warnings + fits)


def _warn(warnings: list[str]) -> None:
    for w in warnings:
        err_console.print(f"warning: {w}", highlight=False, markup=False, soft_wrap=True)


def _fit_warnings(reports: list) -> list[str]:
    """Fits that miss a measured size, and regimes capped at the best measured busbw."""
    from aihpc.bench.calibrate import MAX_BUSBW_OVER_MEASURED

    out = []
    for r in reports:
        if r.max_rel_error > _WARN_REL_ERROR:
            out.append(
                f"{r.collective}/{r.tier} fit misses a measured size by "
                f"{r.max_rel_error:.0%}; measure more sizes or try --regimes 4"
            )
        for i, fitted in r.capped:
            out.append(
                f"{r.collective}/{r.tier} regime {i + 1}: its sizes fit a busbw of "
                f"{fitted:.4g} GB/s, over {MAX_BUSBW_OVER_MEASURED:g}x the best measured "
                f"({r.best_measured_busbw_GBps:.4g} GB/s), which no link gives; written as "
                "the best measured (marked * below). Measure larger sizes in that regime."
            )
    return out


def _calibration_json(output: str, cal: Any, reports: list, warnings: list[str]) -> dict:
    """What `aihpc calibrate` fitted, as --json prints it."""
    return {
        "output": output,
        "comm": [
            {
                "collective": r.collective,
                "tier": r.tier,
                "num_ranks": r.num_ranks,
                "num_points": r.num_points,
                "max_rel_error": r.max_rel_error,
                "single_regime_max_rel_error": r.single_regime_max_rel_error,
                "best_measured_busbw_GBps": r.best_measured_busbw_GBps,
                "regimes": [
                    {
                        "max_bytes": g.max_bytes,
                        "latency_us": g.latency_us,
                        "busbw_GBps": g.busbw_GBps,
                        "fitted_busbw_GBps": dict(r.capped).get(i, g.busbw_GBps),
                    }
                    for i, g in enumerate(r.fit.regimes)
                ],
            }
            for r in reports
        ],
        "gemm": [
            {"precision": p, "points": [list(x) for x in g.points]} for p, g in cal.gemm.items()
        ],
        "overlap_compute_penalty": cal.overlap_compute_penalty,
        "dtensor_op_us": cal.dtensor_op_us,
        "dtensor_optimizer_op_us": cal.dtensor_optimizer_op_us,
        "warnings": warnings,
    }


def _report_calibration(
    output: str, cal: Any, reports: list, as_json: bool, warnings: list[str]
) -> None:
    """What `aihpc calibrate` fitted: one JSON object (with the warnings printed on stderr), or
    a table of regimes and the GEMM span."""
    if as_json:
        print_json(_calibration_json(output, cal, reports, warnings))
        return
    from rich import box

    table = Table(
        title=f"{output}: latency in us, busbw in GB/s", box=box.SIMPLE_HEAD, pad_edge=False
    )
    cols = ("collective", "tier", "n", "sizes", "latency", "busbw", "max err", "1-line")
    for col in cols:
        table.add_column(col, justify="right", no_wrap=True)
    for r in reports:
        prev = 0.0
        for i, g in enumerate(r.fit.regimes):
            span = (
                f"<= {_human(g.max_bytes)}"
                if g.max_bytes != float("inf")
                else (f"> {_human(prev)}")
            )
            first = i == 0
            table.add_row(
                r.collective if first else "",
                r.tier if first else "",
                str(r.num_ranks) if first else "",
                span,
                f"{g.latency_us:.4g}",
                f"{g.busbw_GBps:.4g}" + ("*" if i in dict(r.capped) else ""),
                f"{r.max_rel_error:.1%}" if first else "",
                f"{r.single_regime_max_rel_error:.1%}" if first else "",
            )
            prev = g.max_bytes
    console.print(table)
    for p, g in cal.gemm.items():
        console.print(
            f"gemm {p}: {len(g.points)} points, "
            f"{min(t for _, t in g.points):.3g} .. "
            f"{max(t for _, t in g.points):.3g} TFLOP/s"
        )
    if cal.overlap_compute_penalty is not None:
        console.print(
            f"overlap penalty {cal.overlap_compute_penalty:.3g}: a collective hidden behind "
            "compute on this host still costs this fraction of its time"
        )
    if cal.dtensor_op_us is not None:
        console.print(
            f"DTensor dispatch {cal.dtensor_op_us:.3g} us per op: what eager tensor parallel "
            "and FSDP2 add to each op on this host"
            + (
                f" ({cal.dtensor_optimizer_op_us:.3g} us per op of the optimizer step)"
                if cal.dtensor_optimizer_op_us is not None
                else ""
            )
        )
