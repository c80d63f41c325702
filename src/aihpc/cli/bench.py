"""Measuring commands: ``aihpc bench comm``, ``aihpc bench gemm`` and ``aihpc calibrate``
(``aihpc bench moe`` lives in bench_moe.py).

torch is imported inside the bench commands only, so ``aihpc calibrate`` on an nccl-tests log
works on a laptop without torch.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from aihpc._io import check_output_path, to_json, write_atomic
from aihpc.cli._common import console, err_console, fail, guarded, print_json, require_torch
from aihpc.cli.calibrate_runs import FIT_OPTION, RUNS_CHECK_OPTION, RUNS_OPTION, calibrate_runs
from aihpc.spec.errors import SpecError

__all__ = ["register"]


@contextlib.contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Any]:
    """A rich progress bar on stderr (None when disabled: --json, not rank 0, or no terminal)."""
    if not enabled or not err_console.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        console=err_console,
        transient=True,
        redirect_stdout=sys.stdout.isatty(),
    ) as progress:
        progress.add_task("bench", total=total)
        yield progress


def _comm_worker(cfg: Any, as_json: bool, timeout_s: float, output: str | None) -> dict[str, Any]:
    """Runs on every rank (spawned by --nproc-per-node, or started by torchrun / srun)."""
    from aihpc.bench.collectives import format_footer, format_header, format_row
    from aihpc.bench.comm import device_lines, results_json, run_comm_bench
    from aihpc.bench.dist import init_distributed

    try:
        with init_distributed(timeout_s) as ctx:
            lead = ctx.rank == 0
            devices = device_lines(ctx)
            rows: list[Any] = []
            with _progress(len(cfg.collectives) * len(cfg.sizes), lead and not as_json) as bar:

                def on_start(coll: str, n: int) -> None:
                    rows.clear()
                    if bar is not None:
                        bar.update(bar.task_ids[0], description=coll)
                    if lead and not as_json:
                        print(
                            format_header(
                                coll,
                                n,
                                min(cfg.sizes),
                                max(cfg.sizes),
                                _factor(cfg.sizes),
                                cfg.warmup,
                                cfg.iters,
                                cfg.check,
                                devices,
                            ),
                            flush=True,
                        )

                def on_result(r: Any) -> None:
                    rows.append(r)
                    if bar is not None:
                        bar.advance(bar.task_ids[0])
                    if lead and not as_json:
                        print(
                            format_row(
                                r.size_bytes,
                                r.count,
                                r.dtype,
                                r.redop,
                                r.root,
                                r.out_of_place,
                                r.in_place,
                            ),
                            flush=True,
                        )
                        if len(rows) == len(cfg.sizes):
                            halves = [h for x in rows for h in (x.out_of_place, x.in_place) if h]
                            bad = sum(1 for h in halves if h.wrong)
                            avg = sum(h.busbw_GBps for h in halves) / len(halves)
                            print(format_footer(r.collective, bad, avg), flush=True)

                results = run_comm_bench(ctx, cfg, on_result, on_start)
            return publish(results_json(results, ctx, cfg), lead, as_json, output)
    except SpecError as err:
        # travels back to the parent of spawned workers, which turns it into exit code 2
        return {"spec_error": (err.field, err.value, err.allowed)}


def publish(doc: dict[str, Any], lead: bool, as_json: bool, output: str | None) -> dict:
    """Rank 0 prints the JSON (--json) and writes it (--output); every rank returns the status
    the launcher turns into an exit code."""
    if lead:
        if as_json:
            print_json(doc)
        if output:
            write_atomic(Path(output), to_json(doc, indent=2) + "\n")
    return {"wrong_rows": doc["wrong_rows"]}


# options every distributed bench command takes (comm, moe)
CHECK = typer.Option(1, "-c", "--check", help="1: count wrong elements; 0: off.")
RANKS_PER_NODE = typer.Option(
    None, "--ranks-per-node", help="Override the node split (default: by hostname)."
)
NPROC_PER_NODE = typer.Option(
    None,
    "--nproc-per-node",
    help="Start N local workers (default: one per local GPU, or 2 on CPU; "
    "not used under torchrun / srun).",
)
TIMEOUT = typer.Option(300.0, "--timeout", help="Process-group timeout, s.")
OUTPUT = typer.Option(None, "--output", help="Also write the JSON here.")
AS_JSON = typer.Option(False, "--json", help="Print one JSON object.")


def launch_plan(
    check: int, output: str | None, nproc_per_node: int | None
) -> tuple[dict[str, str] | None, int]:
    """Check the options every distributed bench takes; (launcher env or None, world size).

    A collective on one rank measures nothing: without a launcher the default is every local
    GPU, or 2 processes on a CPU."""
    if check not in (0, 1):
        raise SpecError("-c/--check", check, "allowed: 0 | 1")
    if output:
        check_output_path(Path(output), "--output")
    if nproc_per_node is not None and nproc_per_node < 1:
        raise SpecError("--nproc-per-node", nproc_per_node, "must be >= 1")
    import torch

    from aihpc.bench.dist import launcher_env

    env = launcher_env()
    if env is None and nproc_per_node is None:
        nproc_per_node = torch.cuda.device_count() if torch.cuda.is_available() else 2
    return env, int(env["WORLD_SIZE"]) if env else (nproc_per_node or 1)


def run_workers(
    worker: Any, env: dict[str, str] | None, world: int, args: tuple, unit: str
) -> None:
    """Run ``worker(*args)`` here (under torchrun / srun) or in ``world`` spawned local workers;
    turn a worker's SpecError into exit 2 and wrong results into exit 1 (one line each)."""
    from aihpc.bench.dist import launch_local

    if env is not None:
        status = worker(*args)
    else:
        import torch.multiprocessing as tmp

        try:
            status = launch_local(world, worker, *args)
        except (tmp.ProcessRaisedException, tmp.ProcessExitedException) as err:
            last = [ln for ln in str(err).strip().splitlines() if ln.strip()]
            fail(f"a benchmark worker failed: {last[-1] if last else err}", code=1)
    if status and "spec_error" in status:
        raise SpecError(*status["spec_error"])
    if status and status.get("wrong_rows"):
        fail(f"{status['wrong_rows']} {unit} returned wrong elements (#wrong > 0)", code=1)


# above this the fit is reported but flagged (research notes section 1.4 suggest refusing > 15 %)
_WARN_REL_ERROR = 0.15


def _human(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _factor(sizes: tuple[int, ...]) -> int:
    return sizes[1] // sizes[0] if len(sizes) > 1 else 1


def register(app: typer.Typer) -> None:
    bench_app = typer.Typer(
        help="Micro-benchmarks: collectives (nccl-tests semantics), MoE dispatch / combine "
        "(DeepEP's), GEMM.",
        no_args_is_help=True,
    )
    app.add_typer(bench_app, name="bench")

    _register_comm(bench_app)
    _register_gemm(bench_app)
    from aihpc.cli import bench_moe

    bench_moe.register(bench_app)
    _register_calibrate(app)


def _register_comm(bench_app: typer.Typer) -> None:
    @bench_app.command("comm")
    @guarded
    def comm(
        collective: str = typer.Option(
            "all",
            "--collective",
            "-C",
            help="Comma list of all_reduce, all_gather, "
            "reduce_scatter, all_to_all, broadcast, send_recv; or 'all'.",
        ),
        minbytes: str = typer.Option("1K", "-b", "--minbytes", help="Smallest size (K/M/G)."),
        maxbytes: str = typer.Option("16M", "-e", "--maxbytes", help="Largest size (K/M/G)."),
        stepfactor: int = typer.Option(4, "-f", "--stepfactor", help="Size multiplier."),
        iters: int = typer.Option(20, "-n", "--iters", help="Timed iterations per size."),
        warmup: int = typer.Option(1, "-w", "--warmup-iters", help="Untimed iterations first."),
        datatype: str = typer.Option(
            "float", "-d", "--datatype", help="float | half | bfloat16 | double | int32 | int64"
        ),
        op: str = typer.Option("sum", "-o", "--op", help="sum | prod | max | min | avg"),
        root: int = typer.Option(0, "-r", "--root", help="Root rank of broadcast."),
        check: int = CHECK,
        group: str = typer.Option(
            "world",
            "--group",
            help="world | intra (inside each node: "
            "scale-up tier) | inter (same local rank across nodes: "
            "scale-out tier).",
        ),
        ranks_per_node: int | None = RANKS_PER_NODE,
        nproc_per_node: int | None = NPROC_PER_NODE,
        timeout: float = TIMEOUT,
        output: str | None = OUTPUT,
        as_json: bool = AS_JSON,
    ) -> None:
        """Collective bandwidth sweep with nccl-tests' size, algbw and busbw definitions."""
        require_torch("bench comm")
        from aihpc.bench.collectives import COLLECTIVES, parse_size, size_sweep
        from aihpc.bench.comm_config import CommConfig, group_layout, validate_comm_config

        colls = (
            COLLECTIVES
            if collective == "all"
            else tuple(c.strip() for c in collective.split(",") if c.strip())
        )
        sizes = size_sweep(
            parse_size(minbytes, "-b/--minbytes"), parse_size(maxbytes, "-e/--maxbytes"), stepfactor
        )
        if not timeout > 0:
            raise SpecError("--timeout", timeout, "seconds > 0")
        cfg = CommConfig(
            collectives=colls,
            sizes=tuple(sizes),
            iters=iters,
            warmup=warmup,
            dtype=datatype,
            op=op,
            check=bool(check),
            root=root,
            group=group,
            ranks_per_node=ranks_per_node,
        )
        # every check that needs no torch and no process first: bad input costs no launch
        validate_comm_config(cfg)
        env, world = launch_plan(check, output, nproc_per_node)

        if collective == "all" and world < 2:
            cfg = replace(cfg, collectives=tuple(c for c in colls if c != "send_recv"))
        cfg = validate_comm_config(cfg, world)
        if env is None or ranks_per_node:  # the node of every rank is known before the launch
            group_layout(cfg, [r // (ranks_per_node or world) for r in range(world)])
        run_workers(_comm_worker, env, world, (cfg, as_json, timeout, output), "size(s)")


def _register_gemm(bench_app: typer.Typer) -> None:
    @bench_app.command("gemm")
    @guarded
    def gemm(
        shape: list[str] = typer.Option(
            None,
            "--shape",
            "-s",
            help="MxNxK (or N for a cube); "
            "repeat. Default: cubes 256 .. 2048 on CPU, "
            "1024 .. 16384 on GPU.",
        ),
        precision: str = typer.Option(
            "bf16", "--precision", "-p", help="bf16 | fp16 | fp32 | tf32"
        ),
        iters: int = typer.Option(10, "-n", "--iters", help="Timed iterations per shape."),
        warmup: int = typer.Option(2, "-w", "--warmup-iters", help="Untimed iterations first."),
        output: str | None = typer.Option(None, "--output", help="Also write the JSON here."),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    ) -> None:
        """Achieved TFLOP/s of torch.matmul against shape, at one precision."""
        require_torch("bench gemm")
        from aihpc.bench.gemm import GemmConfig, parse_shape, validate_gemm_config

        shapes = tuple(parse_shape(s) for s in shape or ())
        validate_gemm_config(GemmConfig(shapes, precision, iters, warmup))
        if output:
            check_output_path(Path(output), "--output")
        import torch  # every flag is checked: now the slow import

        from aihpc.bench.gemm import device_name, gemm_json, run_gemm_bench

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if not shapes:
            cubes = (
                (256, 512, 1024, 2048) if device.type == "cpu" else (1024, 2048, 4096, 8192, 16384)
            )
            shapes = tuple((c, c, c) for c in cubes)
        cfg = GemmConfig(shapes, precision, iters, warmup)
        with _progress(len(shapes), not as_json) as bar:
            results = run_gemm_bench(cfg, device, lambda _r: bar and bar.advance(bar.task_ids[0]))
        doc = gemm_json(results, device)
        if output:
            write_atomic(Path(output), to_json(doc, indent=2) + "\n")
        if as_json:
            print_json(doc)
            return
        table = Table(title=f"torch.matmul {precision} on {device_name(device)}")
        for col in ("M", "N", "K", "GFLOP", "time (us)", "TFLOP/s"):
            table.add_column(col, justify="right")
        for r in results:
            table.add_row(
                str(r.m),
                str(r.n),
                str(r.k),
                f"{r.gflop:.3g}",
                f"{r.time_us:.1f}",
                f"{r.tflops:.3f}",
            )
        console.print(table)


def _local_spec_target(spec_path: str | None, local: bool, nproc: int) -> tuple | None:
    """(the spec read, where its local copy goes), checked before anything is measured."""
    if nproc < 1:
        raise SpecError("--nproc", nproc, "must be at least 1")
    if spec_path is None:
        return None
    if not local:
        raise SpecError("--spec", spec_path, "only with --local")
    from aihpc.bench.local import attention_shape
    from aihpc.spec import load_runspec

    spec = load_runspec(spec_path)  # a bad spec is exit 2 before minutes of measuring
    target = Path(Path(spec_path).stem + ".local.toml")  # in the current folder
    check_output_path(target, "--spec")
    mbs = getattr(spec.parallel, "micro_batch_size", None)
    return spec_path, target, attention_shape(spec.model, mbs)


def _measure_local(nproc: int, target: tuple | None) -> tuple[list, dict, dict, tuple]:
    """This host's measurements as calibration points (GEMMs for fp32 and, as the CPU
    runtime trains bf16 specs in fp32, for bf16 too), its gpu_spec table, and (a collective's
    cost inside a step, DTensor's host time per op); the attention kernel and the DTensor
    decoder at the shape of ``target``'s model (``_local_spec_target``), else a default one."""
    import tempfile

    from aihpc.bench.calibrate import load_measurements
    from aihpc.bench.local import DEFAULT_ATTENTION_SHAPE, local_gpu_spec, measure_local

    shape = target[2] if target else DEFAULT_ATTENTION_SHAPE
    with err_console.status(f"measuring this host as {nproc} rank(s)"):
        m = measure_local(nproc, attention=shape)
    with tempfile.TemporaryDirectory(prefix="aihpc-local-") as tmp:
        files = [Path(tmp) / "gemm.json"]
        files[0].write_text(json.dumps(m.gemm))
        if m.comm:
            files.append(Path(tmp) / "comm.json")
            files[-1].write_text(json.dumps(m.comm))
        comm_pts, gemm_pts = load_measurements([str(f) for f in files], None, None, "out-of-place")
    if "fp32" in gemm_pts:
        gemm_pts.setdefault("bf16", list(gemm_pts["fp32"]))
    return comm_pts, gemm_pts, local_gpu_spec(m), (m.call, m.dtensor_op_us)


def _write_local_spec(target: tuple, calibration: Path, device: dict, nproc: int) -> None:
    import os
    import tomllib

    from aihpc.spec.tomlw import dumps_toml

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


def _register_calibrate(app: typer.Typer) -> None:
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
            "calibration.toml", "--output", "-O", help="Calibration TOML to write."
        ),
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
        from aihpc.spec.calibration import COLLECTIVES

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
    from aihpc.spec.calibration import calibration_to_toml

    local_spec = _local_spec_target(spec_path, local, nproc)
    if local:
        require_torch("calibrate --local")
        comm_pts, gemm_pts, device, (call, dtensor_op_us) = _measure_local(nproc, local_spec)
        source = f"aihpc calibrate --local --nproc {nproc}"
    else:
        comm_pts, gemm_pts = load_measurements(inputs or [], tier, collective, column)
        device, call, dtensor_op_us = None, None, None
        source = "aihpc calibrate " + " ".join(Path(p).name for p in inputs or [])
    cal, reports = fit_to_calibration(comm_pts, gemm_pts, source, regimes)
    if call is not None:  # a call inside a training step costs what it costs between GEMMs
        from aihpc.bench.local_sync import with_call_cost

        cal = with_call_cost(cal, call)
    if dtensor_op_us is not None:
        cal = replace(cal, dtensor_op_us=dtensor_op_us)
    header = (
        "Written by `aihpc calibrate`. Time of a collective of whole-buffer size S on "
        "n ranks:\nlatency_us + S * busbw_factor(n) / busbw_GBps / 1e3 (us), in the "
        "regime S falls in."
    )
    write_atomic(Path(output), calibration_to_toml(cal, header))
    if local_spec is not None:
        _write_local_spec(local_spec, Path(output), device, nproc)
    _warn_fits(reports)
    _report_calibration(output, cal, reports, as_json)


def _warn_fits(reports: list) -> None:
    """Fits that miss a measured size, and regimes capped at the best measured busbw."""
    from aihpc.bench.calibrate import MAX_BUSBW_OVER_MEASURED

    for r in reports:
        if r.max_rel_error > _WARN_REL_ERROR:
            err_console.print(
                f"warning: {r.collective}/{r.tier} fit misses a measured size by "
                f"{r.max_rel_error:.0%}; measure more sizes or try --regimes 4",
                highlight=False,
            )
        for i, fitted in r.capped:
            err_console.print(
                f"warning: {r.collective}/{r.tier} regime {i + 1}: its sizes fit a busbw of "
                f"{fitted:.4g} GB/s, over {MAX_BUSBW_OVER_MEASURED:g}x the best measured "
                f"({r.best_measured_busbw_GBps:.4g} GB/s), which no link gives; written as "
                "the best measured (marked * below). Measure larger sizes in that regime.",
                highlight=False,
                soft_wrap=True,
            )


def _report_calibration(output: str, cal: Any, reports: list, as_json: bool) -> None:
    """What `aihpc calibrate` fitted: one JSON object, or a table of regimes and the GEMM span."""
    summary = {
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
    }
    if as_json:
        print_json(summary)
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
        )
