"""Measuring commands: ``aihpc bench comm`` and ``aihpc bench gemm`` (``aihpc bench moe`` lives in
bench_moe.py, what they share in _bench_common.py, ``aihpc calibrate`` in calibrate.py).

torch is imported inside the bench commands only.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from aihpc._io import check_output_path, to_json, write_atomic
from aihpc.cli._bench_common import (
    AS_JSON,
    CHECK,
    NPROC_PER_NODE,
    OUTPUT,
    RANKS_PER_NODE,
    TIMEOUT,
    launch_plan,
    progress,
    publish,
    run_workers,
)
from aihpc.cli._common import console, guarded, print_json, require_torch
from aihpc.runspec.errors import SpecError

__all__ = ["register"]


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
            with progress(len(cfg.collectives) * len(cfg.sizes), lead and not as_json) as bar:

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
        op: str = typer.Option(
            "sum", "--op", help="sum | prod | max | min | avg (nccl-tests' -o)."
        ),
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
        output: str | None = OUTPUT,
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
        with progress(len(shapes), not as_json) as bar:
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
