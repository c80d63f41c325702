"""``aihpc rl estimate RUN.toml`` and ``aihpc rl search RUN.toml``: an RL step ([rl]) priced as
its phases, and the search over the GPU split, the rollout engines' and the training layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from aihpc.cli._common import guarded, print_json
from aihpc.runspec import SpecError, load_runspec

__all__ = ["register"]

_RUNSPEC = typer.Argument(..., help="Run spec TOML with an [rl] table (docs/rl.md).")


def register(app: typer.Typer) -> None:
    rl_app = typer.Typer(
        help="RL post-training (GRPO, RLOO, PPO): a step's phases priced; the search over "
        "placements and layouts.",
        no_args_is_help=True,
    )
    app.add_typer(rl_app, name="rl")
    _register_estimate(rl_app)
    _register_search(rl_app)
    from aihpc.cli.rl_train import register_train

    register_train(rl_app)


def _register_estimate(rl_app: typer.Typer) -> None:
    @rl_app.command("estimate")
    @guarded
    def estimate(
        runspec: Path = _RUNSPEC,
        steps: int | None = typer.Option(
            None, "--steps", help="RL steps of the run: its time and GPU-hours (no failures)."
        ),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    ) -> None:
        """One RL step: each phase's seconds, the critical path, tokens/s/GPU, memory."""
        from aihpc.perf.rl import estimate_rl

        if steps is not None and steps < 1:
            raise SpecError("--steps", steps, "must be >= 1")
        est = estimate_rl(_load(runspec))
        run = None
        if steps is not None:
            hours = steps * est.step_time_s / 3600
            run = {"steps": steps, "hours": hours, "gpu_hours": hours * est.num_gpus}
        if as_json:
            print_json(est.to_json() | ({"run": run} if run else {}))
        else:
            typer.echo("\n".join(estimate_lines(est)))
            if run:
                typer.echo(
                    f"{steps:,} steps: {run['hours']:,.1f} h on {est.num_gpus} GPUs, "
                    f"{run['gpu_hours']:,.0f} GPU-hours (no failures priced)"
                )
        if not est.fits:  # as `aihpc estimate`: exit 1, after the answer, when it does not fit
            raise typer.Exit(1)


def _register_search(rl_app: typer.Typer) -> None:
    @rl_app.command("search")
    @guarded
    def search(
        runspec: Path = _RUNSPEC,
        top: int = typer.Option(5, "--top", help="Layouts to show (>= 1)."),
        output: Path | None = typer.Option(
            None, "--output", "-o", help="Write the fastest layout as a run spec (.toml)."
        ),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    ) -> None:
        """Colocated vs every split of whole nodes, the rollout tp (and ep), the best training
        plans: fastest step first."""
        from aihpc._io import check_output_path
        from aihpc.perf.rl.search import search_rl

        if top < 1:
            raise SpecError("--top", top, "must be >= 1")
        if output is not None:
            check_output_path(output, "--output", ".toml")
        spec = _load(runspec)
        found = search_rl(spec)
        if output is not None and found.ranked:
            write_rl_layout(spec, found.ranked[0], output)
        best = found.ranked[:top]
        if as_json:
            print_json(
                {
                    "evaluated": found.evaluated,
                    "refused": found.refused,
                    "ranked": [e.to_json() for e in best],
                }
            )
            return
        if not best:
            raise SpecError("RUNSPEC", str(runspec), "no layout fits: see `aihpc rl estimate`")
        typer.echo(f"{found.evaluated} layouts priced, {found.refused} refused or not fitting")
        for i, est in enumerate(best, 1):
            typer.echo(f"{i}. {_layout(est)}  step {est.step_time_s:.1f} s  ({est.bottleneck})")
        if output is not None:
            typer.echo(f"run spec of layout 1 written to {output}")


def write_rl_layout(spec: Any, best: Any, path: Path) -> None:
    """The run spec with ``best``'s [parallel] plan and [rl] placement and engine layout (the
    original's other tables as they were; comments are not kept)."""
    import tomllib

    from aihpc._io import write_atomic
    from aihpc.runspec.tomlw import dumps_toml

    data = tomllib.loads(Path(spec.path).read_text(encoding="utf-8-sig"))
    data["parallel"] = best.plan.as_dict()
    rl = dict(data["rl"])
    rl["placement"] = best.rl.placement
    if best.rl.offload != spec.rl.offload:  # the search kept verl's state on the GPUs
        rl["offload"] = best.rl.offload
    rl.pop("rollout_gpus", None)
    rl.pop("weight_sync", None)  # auto: the placement's own
    if best.rl.placement == "disaggregated":
        rl["rollout_gpus"] = best.rollout_gpus
    rollout = dict(rl.get("rollout", {}))
    rollout.update(tp=best.rl.rollout.tp, ep=best.rl.rollout.ep)
    rl["rollout"] = rollout
    data["rl"] = rl
    header = (
        f"Written by `aihpc rl search {spec.path}`: its fastest layout, step "
        f"{best.step_time_s:.1f} s.\nThe [parallel] table and the [rl] placement and engine "
        "layout are the search's; every other field is the searched run spec's."
    )
    write_atomic(path, dumps_toml(data, header), "--output")


def _load(path: Path) -> Any:
    spec = load_runspec(path)
    if spec.rl is None:
        raise SpecError("RUNSPEC", str(path), "has no [rl] table (docs/rl.md)")
    return spec


def _layout(est: Any) -> str:
    p = est.plan
    train = f"train tp{p.tp} pp{p.pp} cp{p.cp} ep{p.ep} dp{p.dp} zero{p.zero_stage}"
    if p.recompute != "none":
        train += f" recompute {p.recompute}"
    if p.micro_batch_size > 1:
        train += f" mbs {p.micro_batch_size}"
    if est.rl.placement == "colocated":
        where = f"colocated on {est.num_gpus}"
        if est.rl.offload == "none":
            where += " (state kept on the GPUs)"
    else:
        where = f"disaggregated {est.rollout_gpus} rollout + {est.train_gpus} train"
    engine = f"rollout tp{est.rl.rollout.tp}" + (
        f" ep{est.rl.rollout.ep}" if est.rl.rollout.ep > 1 else ""
    )
    return f"{where}, {engine}, {train}"


def estimate_lines(est: Any) -> list[str]:
    """The estimate as text: the layout, each phase, the step and its largest phase."""
    rl = est.rl
    mode = f"asynchronous (staleness {rl.staleness})" if rl.staleness else "synchronous"
    lines = [
        f"{rl.algorithm.upper()}: {rl.prompts_per_step} prompts x {rl.samples_per_prompt} samples"
        f", {rl.prompt_len} + {rl.response_len} tokens (max {rl.response_cap}); {mode}",
        _layout(est),
        "phase              seconds",
    ]
    if rl.generated_prompts != rl.prompts_per_step:  # DAPO's dynamic sampling
        rounds = f" x {rl.generation_rounds} rounds" if rl.generation_rounds > 1 else ""
        lines.insert(
            1,
            f"dynamic sampling: {rl.round_prompts} prompts generated a round{rounds}, "
            f"{rl.prompts_per_step} of them trained on",
        )
    for name, value in est.phases_s.items():
        if value or name in ("rollout", "update"):  # a phase this step has
            lines.append(f"  {name:16s} {value:8.1f}")
    r = est.rollout
    tail = (
        f"; the last 10% of responses take {r.tail_share:.0%} of it" if r.tail_share >= 0.01 else ""
    )
    lines.append(
        f"rollout: {r.engines} engines x {r.slots} sequences at once, KV cache "
        f"{r.kv_cache_gib:.1f} GiB/GPU{tail}"
    )
    if est.switch_gib:
        moved = f"{est.switch_gib:.1f} GiB/GPU to host and back"
        if est.rl.offload == "none":  # the engine's sleep and wake alone
            moved = f"the training state stays; the engine's weights, {moved}"
        lines.append(f"host offload ({est.rl.offload}): {moved}")
    lines.append(
        f"step {est.step_time_s:.1f} s, {est.tokens_per_s_per_gpu:.0f} tokens/s/GPU; "
        f"largest phase {est.bottleneck}"
    )
    lines += [f"note: {n}" for n in est.notes]
    return lines


def validate_rl_command(as_json: bool, runs: Path | None) -> None:
    """``aihpc validate --rl [--runs CSV]``: predicted vs measured RL steps, MAPE per set."""
    import os

    from aihpc.perf.fit.rl_validate import validate_phases, validate_refit, validate_rl

    if runs is not None and not os.path.exists(runs):
        raise SpecError("--runs", str(runs), "file not found")
    report = validate_rl(runs)
    refits = validate_refit() if runs is None else []
    phases = validate_phases() if runs is None else []
    if as_json:
        extra = {"refit": [r.to_json() for r in refits], "phases": [p.to_json() for p in phases]}
        print_json(report.to_json() | extra)
        return
    typer.echo(f"{'run':30s} {'measured s':>10s} {'predicted s':>11s} {'error':>7s}")
    for r in report.rows:
        typer.echo(f"{r.id:30s} {r.measured_s:10.1f} {r.predicted_s:11.1f} {r.error:+7.0%}")
    for which in sorted({r.set for r in report.rows}):
        typer.echo(
            f"{which}: MAPE {report.mape(which):.0%}, worst {report.worst(which):.0%} "
            f"({sum(r.set == which for r in report.rows)} runs)"
        )
    if refits:
        typer.echo("\nweight sync alone (NeMo-RL's measured refits)")
        for f in refits:
            typer.echo(
                f"{f.id:30s} {f.measured_low_s:4.2f}-{f.measured_high_s:4.2f} s "
                f"{f.predicted_s:11.2f} {f.error:+7.0%}"
            )
    if phases:
        _echo_phases(phases)


def _echo_phases(phases: list) -> None:
    """The published phase breakdowns: measured / predicted seconds and the error per phase."""
    names = list(phases[0].measured)
    typer.echo("\nphases, measured / predicted s (published breakdowns)")
    typer.echo(f"{'run':22s} " + " ".join(f"{n:>19s}" for n in names))
    for p in phases:
        cells = [f"{p.measured[n]:5.0f} /{p.predicted[n]:6.1f} {p.error(n):+5.0%}" for n in names]
        typer.echo(f"{p.id:22s} " + " ".join(f"{c:>19s}" for c in cells))
