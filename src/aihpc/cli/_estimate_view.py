"""How ``aihpc estimate`` prints one estimate: the plan and the software facts it priced, the step's
terms and what was hidden behind compute, the memory, throughput and MFU (and on which peak),
the parameters, the bottleneck.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aihpc.cli import _common
from aihpc.cli._plan_views import render_calibration
from aihpc.perf.step.moe_stack import stack_of
from aihpc.runspec import RunSpec

if TYPE_CHECKING:  # the planner loads inside the commands
    from aihpc.perf.fit.calibration_use import CalibrationUse
    from aihpc.perf.step.estimate import Estimate

__all__ = ["TIME_LABELS", "plan_line", "render_estimate", "yes_no"]


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


def yes_no(flag: bool) -> str:
    """How every table and plan line shows an on/off plan field (sequence parallelism)."""
    return "y" if flag else "n"


def plan_line(plan: dict) -> str:
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
        + f" · zero {plan['zero_stage']} · sp {yes_no(plan['sequence_parallel'])}"
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
            (
                f"MoE dispatch {stack.dispatcher} ({stack.id})"
                if (stack := stack_of(tr)) is not None
                else f"MoE dispatch {tr.moe_dispatcher}"
            )
            + f" in {tr.moe_dispatch_dtype}"
            + (f", busiest rank {tr.moe_imbalance:g}x balanced" if tr.moe_imbalance > 1 else "")
            + (", one GEMM launch per expert" if tr.moe_expert_gemm == "per_expert" else "")
        )
    if tr.precision == "fp8":
        kept = tr.fp8_saved_inputs
        if kept == "deepseek":
            kept = "fp8, SwiGLU inputs too, attention output once in E5M6 (DeepSeek-V3)"
        parts.append(f"FP8 linear inputs kept in {kept}")
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
    _common.console.print(f"plan: {plan_line(out['plan'])}")
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
    hidden = _hidden_line(est)
    if hidden:
        _common.console.print(f"[dim]{hidden}[/]")
    mt = Table(title=f"Memory per GPU ({est.memory.stage} stage, GiB)", show_edge=False)
    mt.add_column("part")
    mt.add_column("GiB", justify="right")
    for key, value in out["memory_gib"].items():
        if key != "total":
            mt.add_row(key, f"{value:.1f}")
    fit = "[green]fits[/]" if est.fits else "[red]does NOT fit[/]"
    if est.headroom_gib:
        fit += f" with {est.headroom_gib:g} GiB kept free"
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
        f"{est.model_tflops_per_gpu:.0f} · MFU [bold]{est.mfu:.1%}[/] · HFU {est.hfu:.1%} "
        f"({_peak_basis(est)})"
    )
    if est.params is not None:
        _common.console.print(f"parameters: {_params_line(est.params, est.plan)}")
    _common.console.print(f"[bold]Bottleneck:[/] {est.bottleneck}")


def _peak_basis(est: Estimate) -> str:
    """On which peak MFU is quoted: the run's precision's dense peak; an FP8 run also over the
    BF16 peak, as Megatron-LM and NeMo quote it."""
    text = f"of the {est.precision.upper()} dense peak, {est.peak_tflops:,.0f} TFLOP/s"
    if est.precision != "bf16" and est.bf16_peak_tflops:
        bf16 = est.model_tflops_per_gpu / est.bf16_peak_tflops
        text += f"; MFU {bf16:.1%} of the BF16 peak, Megatron's and NeMo's basis"
    return text


def _count(n: float) -> str:
    return f"{n / 1e9:,.2f} B" if n >= 1e8 else f"{n / 1e6:,.2f} M" if n >= 1e5 else f"{n:,.0f}"


def _params_line(p: Any, plan: Any) -> str:
    parts = [f"{_count(p.total)} total"]
    if p.active != p.total:
        parts.append(f"{_count(p.active)} active per token")
    if plan.pp > 1:
        parts.append(f"{_count(p.first_stage)} first stage, {_count(p.last_stage)} last")
    parts.append(f"{_count(p.per_gpu)} per GPU (TP rank 0 of the first stage, before ZeRO)")
    return " · ".join(parts)


HIDDEN_LABELS = {
    "tp_comm": "tensor-parallel",
    "cp_comm": "context-parallel",
    "ep_comm": "expert-parallel all-to-all",
    "dp_comm": "data-parallel",
}


def _hidden_line(est: Estimate) -> str:
    """The communication the plan hides behind compute (priced, not in the step time), so a term
    missing from the table reads as hidden, not as forgotten."""
    parts = [
        f"{HIDDEN_LABELS[k]} {v:.3f} s"
        + (
            f" ({est.plan.moe_a2a_overlap} overlap)"
            if k == "ep_comm" and est.plan.moe_a2a_overlap != "none"
            else ""
        )
        for k, v in est.hidden_s.items()
        if v >= 0.0005
    ]
    return "hidden behind compute (not in the step): " + ", ".join(parts) if parts else ""
