"""What ``aihpc estimate`` and ``aihpc search`` print for a vision-language run spec (one with
``[model.vision]``), and ``aihpc validate --vlm``'s table: the encoder's placement, its terms and
the imbalance beside the language model's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import typer

from aihpc.cli import _common
from aihpc.cli._common import print_json

if TYPE_CHECKING:  # the planner loads inside the command
    from aihpc.perf.fit.vlm_validate import VlmReport
    from aihpc.perf.multimodal import VlmEstimate
    from aihpc.runspec import RunSpec

__all__ = [
    "refuse_vlm_flags",
    "vlm_estimate",
    "vlm_preset_rows",
    "vlm_presets_table",
    "vlm_search",
    "vlm_validation_table",
]

_TERMS = ("compute", "recompute", "tp_comm", "dp_comm", "pipeline_bubble", "encoder")
_TERMS += ("encoder_imbalance", "encoder_dp_comm", "encoder_optimizer", "encoder_fill")
_TERMS += ("cross_attention", "data_loader")


def _plan_text(e: VlmEstimate) -> str:
    p = e.llm.plan
    shape = f"tp{p.tp} pp{p.pp} v{p.vpp} cp{p.cp} dp{p.dp}"
    return f"{shape} z{p.zero_stage} {p.recompute} mbs{p.micro_batch_size}"


def _where(e: VlmEstimate) -> str:
    if e.placement in ("stage", "pool"):
        idle = f", {e.idle_gpus} idle" if e.idle_gpus else ""
        return f"{e.placement} (tp{e.encoder_tp}, {e.encoder_gpus} GPUs{idle})"
    return f"{e.placement} (tp{e.encoder_tp})"


def vlm_estimate(spec: RunSpec, json_out: bool) -> None:
    """``aihpc estimate`` of a vision-language spec: its placement (auto: tp) priced; exits 1
    when the plan does not fit."""
    from aihpc.perf.multimodal import estimate_vlm

    est = estimate_vlm(spec)
    if json_out:
        out = est.to_json()
        out["model"] = spec.model.name
        print_json(out)
    else:
        con = _common.console
        con.print(
            f"{spec.model.name} on {spec.cluster.num_gpus} × {spec.cluster.gpu.id}, encoder "
            f"{_where(est)}; language model {_plan_text(est)}",
            highlight=False,
        )
        con.print(
            f"step {est.step_time_s:.3f} s · {est.samples_per_s_per_gpu:.3f} samples/s/GPU · "
            f"{est.tokens_per_s_per_gpu:,.0f} tokens/s/GPU · memory {est.memory_gib:.1f} GiB "
            f"(encoder {est.encoder_memory_gib:.1f}) of {est.llm.hbm_gib:.0f}",
            highlight=False,
        )
        terms = " · ".join(f"{k} {est.time_s[k]:.3f}" for k in _TERMS if est.time_s.get(k))
        con.print(f"terms (s): {terms}", highlight=False)
    if not est.fits:
        raise typer.Exit(1)


def refuse_vlm_flags(flags: dict[str, Any]) -> None:
    """The search options a vision-language spec does not take yet, refused in one line."""
    from aihpc.runspec import SpecError

    for flag, given in flags.items():
        if given:
            raise SpecError(
                flag, given, "not with a vision-language run spec yet ([model.vision]): omit it"
            )


def _trainer_refusal(spec: RunSpec, e: VlmEstimate) -> Any:
    """What `aihpc train` says to one (plan, placement): None where it runs it (the rules it
    checks before it starts, runspec/rules.py and vlm_rules.py)."""
    from aihpc.runspec.rules import trainer_refusal
    from aihpc.runspec.vlm_rules import trainer_placement_refusal

    return trainer_placement_refusal(e.placement, e.encoder_tp) or trainer_refusal(
        spec, e.llm.plan, spec.cluster.num_gpus
    )


def _runnable_only(spec: RunSpec, result: Any, top: int) -> Any:
    """--runnable: only the (plan, placement) pairs the trainer runs, best first."""
    from dataclasses import replace

    kept = [e for e in result.plans if _trainer_refusal(spec, e) is None]
    best: dict[str, VlmEstimate] = {}
    for e in kept:
        best.setdefault(e.placement, e)
    return replace(result, plans=kept[:top], best_by_placement=best)


def vlm_search(spec: RunSpec, top: int, json_out: bool, runnable: bool = False) -> None:
    """``aihpc search`` of a vision-language spec: plans x placements, and the best of each
    placement side by side; each marked with whether `aihpc train` runs it (``runnable``:
    only those)."""
    from aihpc.perf.multimodal.search import search_vlm

    result = search_vlm(spec, top=None if runnable else top)
    if runnable:
        result = _runnable_only(spec, result, top)
    if json_out:
        out = result.to_json(top)
        for e, j in zip(result.plans[:top], out["plans"], strict=True):
            err = _trainer_refusal(spec, e)
            j["runnable"], j["trainer_refuses"] = err is None, None if err is None else str(err)
        print_json(out)
        return
    con = _common.console
    con.print(
        f"{spec.model.name} on {spec.cluster.num_gpus} × {spec.cluster.gpu.id}: "
        f"{result.llm_plans:,} language-model plans evaluated, {result.priced:,} "
        "(plan, placement) pairs priced",
        highlight=False,
    )
    if not result.plans:
        con.print("No plan fits.")
        raise typer.Exit(1)
    lines = [_header()]
    lines += [_row(e) for e in result.plans[:top]]
    con.print("\n".join(lines), highlight=False)
    con.print("\nBest plan of each encoder placement:", highlight=False)
    best = sorted(result.best_by_placement.values(), key=lambda e: -e.samples_per_s_per_gpu)
    con.print("\n".join([_header(), *(_row(e) for e in best)]), highlight=False)
    runs = sum(_trainer_refusal(spec, e) is None for e in result.plans[:top])
    con.print(
        f"\nthe trainer (aihpc train) runs {runs} of the {len(result.plans[:top])} listed"
        + ("" if runnable else " (--runnable: only the pairs it runs)"),
        highlight=False,
    )


def _header() -> str:
    return (
        "| encoder | language model | step s | samples/s/GPU | encoder s | imbalance s | "
        "memory GiB |\n|---|---|---:|---:|---:|---:|---:|"
    )


def _row(e: VlmEstimate) -> str:
    enc = e.time_s.get("encoder", 0.0) + e.time_s.get("encoder_fill", 0.0)
    return (
        f"| {_where(e)} | {_plan_text(e)} | {e.step_time_s:.2f} | "
        f"{e.samples_per_s_per_gpu:.3f} | {enc:.2f} | "
        f"{e.time_s.get('encoder_imbalance', 0.0):.2f} | {e.memory_gib:.1f} |"
    )


def vlm_validation_table(report: VlmReport) -> str:
    lines = [
        "| id | model | GPUs | held out | encoder | measured samples/s/GPU | predicted | error |",
        "|---|---|---:|---|---|---:|---:|---:|",
    ]
    for r in report.rows:
        lines.append(
            f"| {r.id} | {r.model} | {r.num_gpus} | {'yes' if r.heldout else ''} | "
            f"{r.estimate.placement} | {r.measured:.3f} | {r.predicted:.3f} | {r.error:+.1%} |"
        )
    dev, held = report.subset_mape(False), report.subset_mape(True)
    lines.append("")
    lines.append(
        f"MAPE {report.mape:.1%} (development {_pct(dev)}, held out {_pct(held)}), "
        f"max |error| {report.max_error:.1%}; targets 15% / 30%: "
        + ("met" if report.passed else "NOT met")
    )
    return "\n".join(lines)


def _pct(x: Any) -> str:
    return "-" if x is None else f"{x:.1%}"


def print_vlm_validation(report: VlmReport, json_out: bool) -> None:
    if json_out:
        print_json(report.to_json())
    else:
        typer.echo(vlm_validation_table(report))


def vlm_preset_rows() -> list[dict[str, Any]]:
    """Every vision-language preset: its language model's and encoder's sizes, the tokens an
    image becomes, and the source."""
    from aihpc.perf.multimodal.encoder import encoder_params, projector_params
    from aihpc.perf.step.flops import num_params
    from aihpc.runspec import runspec_from_dict
    from aihpc.runspec.vision import vlm_presets

    rows = []
    for name in sorted(vlm_presets()):
        spec = runspec_from_dict(
            {"model": {"preset": name}, "cluster": {"gpu": "h100-sxm", "num_gpus": 8}}
        )
        v = spec.vision
        assert v is not None
        rows.append(
            {
                "preset": name,
                "llm_params": num_params(spec.model),
                "encoder_params": encoder_params(v),
                "projector_params": projector_params(v, spec.model.hidden_size),
                "encoder_layers": v.num_layers,
                "encoder_hidden": v.hidden_size,
                "resolution": v.resolution,
                "tokens_per_tile": v.tokens_per_tile if v.resolution == "tiles" else None,
                "max_image_tokens": v.max_image_tokens,
                "cross_attention_layers": v.cross_attention_layers,
                "source": vlm_presets()[name]["source"],
            }
        )
    return rows


def vlm_presets_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "Vision-language presets: [model] preset = NAME ([model.vision] from the preset)",
        "| preset | LLM params | encoder | projector | encoder layers x width | tokens a tile | "
        "max tokens an image |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        tile = f"{r['tokens_per_tile']:,}" if r["tokens_per_tile"] else "native"
        lines.append(
            f"| {r['preset']} | {r['llm_params'] / 1e9:.1f}B | {r['encoder_params'] / 1e9:.2f}B | "
            f"{r['projector_params'] / 1e6:.0f}M | {r['encoder_layers']} x {r['encoder_hidden']:,} "
            f"| {tile} | {r['max_image_tokens']:,} |"
        )
    return "\n".join(lines)
