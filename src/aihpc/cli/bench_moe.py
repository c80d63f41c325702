"""``aihpc bench moe``: MoE dispatch / combine as DeepEP's tests measure it (aihpc.bench.moe).

torch is imported inside the command only.
"""

from __future__ import annotations

from typing import Any

import typer

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
from aihpc.cli._common import guarded
from aihpc.runspec.errors import SpecError

__all__ = ["register"]


def _moe_worker(cfg: Any, as_json: bool, timeout_s: float, output: str | None) -> dict[str, Any]:
    """Runs on every rank (spawned by --nproc-per-node, or started by torchrun / srun)."""
    from aihpc.bench.comm import device_lines
    from aihpc.bench.dist import init_distributed
    from aihpc.bench.moe import (
        format_footer,
        format_header,
        format_row,
        moe_results_json,
        run_moe_bench,
    )

    try:
        with init_distributed(timeout_s) as ctx:
            lead = ctx.rank == 0
            devices = device_lines(ctx)
            rows: list[Any] = []
            total = len(cfg.tokens) * len(cfg.impls)
            with progress(total, lead and not as_json) as bar:

                def on_result(r: Any) -> None:
                    if bar is not None:
                        bar.advance(bar.task_ids[0])
                    if lead and not as_json:
                        if not rows:
                            print(format_header(cfg, r, devices), flush=True)
                        print(format_row(r), flush=True)
                    rows.append(r)

                results = run_moe_bench(ctx, cfg, on_result)
            if lead and not as_json:
                print(format_footer(results), flush=True)
            return publish(moe_results_json(results, ctx, cfg), lead, as_json, output)
    except SpecError as err:
        return {"spec_error": (err.field, err.value, err.allowed)}


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise SpecError(flag, text, "a comma list of integers, e.g. 512,4096") from None
    if not values:
        raise SpecError(flag, text, "at least one integer")
    return values


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("moe")
    @guarded
    def moe(
        tokens: str | None = typer.Option(
            None,
            "--tokens",
            "-t",
            help="Tokens per rank, comma list (default: 4096 on GPU as DeepEP; 256,1024 on CPU).",
        ),
        hidden: int | None = typer.Option(
            None, "--hidden", help="Hidden size (default: 7168 on GPU, 512 on CPU)."
        ),
        topk: int = typer.Option(8, "--topk", "-k", help="Experts per token."),
        experts: int | None = typer.Option(
            None,
            "--experts",
            "-E",
            help="Experts, rounded down to a multiple of the ranks (default: 256 GPU, 64 CPU).",
        ),
        topk_groups: int | None = typer.Option(
            None,
            "--topk-groups",
            help="Nodes a token may use (node-limited routing; default min(nodes, 4)).",
        ),
        datatype: str = typer.Option(
            "bfloat16", "-d", "--datatype", help="bfloat16 | half | float | double"
        ),
        impl: str = typer.Option(
            "all", "--impl", help="Comma list of ours, ours_hier, a2a_single; or 'all'."
        ),
        iters: int = typer.Option(20, "-n", "--iters", help="Timed iterations per size."),
        warmup: int = typer.Option(2, "-w", "--warmup-iters", help="Untimed iterations first."),
        check: int = CHECK,
        ranks_per_node: int | None = RANKS_PER_NODE,
        nproc_per_node: int | None = NPROC_PER_NODE,
        seed: int = typer.Option(0, "--seed", help="Seed of the routing and the tokens."),
        timeout: float = TIMEOUT,
        output: str | None = OUTPUT,
        as_json: bool = AS_JSON,
    ) -> None:
        """MoE dispatch / combine with DeepEP's per-rank GB/s, ours beside all_to_all_single.

        Implementations: ours (flat), ours_hier (2+ nodes), a2a_single (a plain dispatcher on
        torch's all_to_all_single). The JSON calibrates the model's all_to_all (`aihpc
        calibrate`)."""
        from aihpc.bench.moe import IMPLS, MoEBenchConfig, validate_moe_config

        env, world = launch_plan(check, output, nproc_per_node)
        impls = IMPLS if impl == "all" else tuple(i.strip() for i in impl.split(",") if i.strip())
        import torch

        gpu = torch.cuda.is_available()
        cfg = validate_moe_config(
            MoEBenchConfig(
                tokens=_ints(tokens, "--tokens") if tokens else ((4096,) if gpu else (256, 1024)),
                hidden=hidden or (7168 if gpu else 512),
                topk=topk,
                experts=experts or (256 if gpu else 64),
                topk_groups=topk_groups,
                dtype=datatype,
                impls=impls,
                iters=iters,
                warmup=warmup,
                check=bool(check),
                ranks_per_node=ranks_per_node,
                seed=seed,
            ),
            world,
        )
        run_workers(_moe_worker, env, world, (cfg, as_json, timeout, output), "row(s)")
