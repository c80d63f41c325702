"""``aihpc infer``: price serving a run spec's model on its GPUs (the ``[inference]`` table,
options override it): one static batch, steady-state serving, or disaggregated pools; with
``--search``, the serving plans that meet a latency target, best throughput per GPU first."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from aihpc.cli._common import RUNSPEC_HELP, guarded, print_json
from aihpc.runspec import SpecError, load_runspec

if TYPE_CHECKING:
    from aihpc.runspec import RunSpec
    from aihpc.runspec.inference import InferenceSpec as InferenceConfig

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    @app.command()
    @guarded
    def infer(
        runspec: Path = typer.Argument(..., help=RUNSPEC_HELP),
        mode: str | None = typer.Option(None, help="static | serving | disaggregated."),
        batch: int | None = typer.Option(None, help="Sequences (static) or in flight (serving)."),
        prompt_len: int | None = typer.Option(None, "--prompt-len", help="Prompt tokens."),
        output_len: int | None = typer.Option(None, "--output-len", help="Output tokens."),
        tp: int | None = typer.Option(None, help="Tensor parallel."),
        pp: int | None = typer.Option(None, help="Pipeline stages."),
        dp: int | None = typer.Option(None, help="Attention data parallel (DP attention)."),
        ep: int | None = typer.Option(None, help="Expert parallel (MoE)."),
        kv_dtype: str | None = typer.Option(None, "--kv-dtype", help="bf16 | fp16 | fp8."),
        weight_dtype: str | None = typer.Option(
            None, "--weight-dtype", help="bf16 | fp16 | fp8 | int8 | int4."
        ),
        search: bool = typer.Option(False, "--search", help="Rank serving plans instead."),
        tpot_ms: float | None = typer.Option(None, "--tpot-ms", help="TPOT target (search)."),
        ttft_ms: float | None = typer.Option(None, "--ttft-ms", help="TTFT target (search)."),
        gpus: int | None = typer.Option(
            None, help="GPUs a searched plan may use (default: [cluster] num_gpus)."
        ),
        top: int = typer.Option(5, help="Plans to show (search)."),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    ) -> None:
        """Inference: TTFT, TPOT, tokens/s per GPU and per request, memory and the bottleneck
        (docs/inference.md)."""
        from aihpc.runspec.inference import inference_from_table

        spec = load_runspec(runspec)
        overrides = {
            "mode": mode,
            "batch": batch,
            "prompt_len": prompt_len,
            "output_len": output_len,
            "tp": tp,
            "pp": pp,
            "dp": dp,
            "ep": ep,
            "kv_dtype": kv_dtype,
            "weight_dtype": weight_dtype,
            "tpot_ms": tpot_ms,
            "ttft_ms": ttft_ms,
        }
        cfg = inference_from_table(spec.inference.to_json(), overrides)
        if top < 1:
            raise SpecError("--top", top, "a whole number >= 1")
        if search:
            _search(spec, cfg, gpus if gpus is not None else spec.cluster.num_gpus, top, json_out)
            return
        report = _price(spec, cfg)
        if json_out:
            print_json(report)
        else:
            typer.echo("\n".join(_lines(spec, cfg, report)))


def _price(spec: RunSpec, cfg: InferenceConfig) -> dict[str, Any]:
    from aihpc.perf.infer.config import prefill_plan_of, serving_load, serving_plan
    from aihpc.perf.infer.estimate import (
        bottleneck_sentence,
        engine_for,
        estimate_inference,
        weight_read_s,
    )
    from aihpc.perf.infer.serving import disaggregated, steady_state

    model, cluster = spec.model, spec.cluster
    head = {"model": model.name, "gpu": cluster.gpu.id, "mode": cfg.mode}
    if cfg.mode == "static":
        p = serving_plan(cfg)
        est = estimate_inference(
            model,
            cluster,
            batch=cfg.batch or 1,
            prompt_len=cfg.prompt_len,
            output_len=cfg.output_len,
            tp=p.tp,
            pp=p.pp,
            dp=p.dp,
            ep=p.ep,
            kv_dtype=p.kv_dtype,
            weight_dtype=p.weight_dtype,
            block_size=p.block_size,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            max_batched_tokens=cfg.max_batched_tokens,
            software=p.software,
            moe_imbalance=p.moe_imbalance,
        )
        return {**head, **est.to_json()}
    if cfg.mode == "serving":
        est = steady_state(model, cluster, serving_plan(cfg), serving_load(cfg), batch=cfg.batch)
        out = est.to_json()
        reads = weight_read_s(engine_for(model, cluster, serving_plan(cfg))[0], est.memory)
        out["bottleneck"] = bottleneck_sentence(est.step, est.memory, cfg.tp, reads)
        return {**head, **out}
    dis = disaggregated(
        model, cluster, prefill_plan_of(cfg), serving_plan(cfg), serving_load(cfg), None, cfg.batch
    )
    out = dis.to_json()
    reads = weight_read_s(engine_for(model, cluster, serving_plan(cfg))[0], dis.decode.memory)
    out["bottleneck"] = bottleneck_sentence(dis.decode.step, dis.decode.memory, cfg.tp, reads)
    return {**head, **out}


def _plan_text(plan: dict[str, Any]) -> str:
    return (
        f"tp {plan['tp']}, pp {plan['pp']}, dp {plan['dp']}, ep {plan['ep']} "
        f"({plan['gpus']} GPUs); weights {plan['weight_dtype']}, KV {plan['kv_dtype']}"
    )


def _memory_line(mem: dict[str, Any]) -> str:
    return (
        f"memory per GPU: weights {mem['weights_gib']:.1f} GiB, KV cache "
        f"{mem['kv_cache_gib']:.1f} of {max(mem['kv_capacity_gib'], 0):.1f} GiB, activations "
        f"{mem['activations_gib']:.1f}, runtime {mem['runtime_gib']:.1f}; "
        f"{mem['kv_bytes_per_token'] / 1024:.0f} KiB of KV per token; fits "
        f"{mem['max_batch']:,} sequences"
    )


def _lines(spec: RunSpec, cfg: InferenceConfig, r: dict[str, Any]) -> list[str]:
    gpu = spec.cluster.gpu.name
    if r["mode"] == "disaggregated":
        d = r["decode"]
        return [
            f"{spec.model.name} on {gpu}, disaggregated: prefill pool tp {cfg.prefill_tp} dp "
            f"{cfg.prefill_dp} ep {cfg.prefill_ep}; decode pool {_plan_text(d['plan'])}",
            f"  prefill       {r['prefill_tokens_per_s_per_gpu']:,.0f} prompt tokens/s per GPU",
            f"  KV transfer   {r['kv_transfer_s'] * 1e3:.1f} ms per prompt",
            f"  TTFT          {r['ttft_s'] * 1e3:,.0f} ms (prefill step + transfer, no queue)",
            f"  TPOT          {d['tpot_s'] * 1e3:.1f} ms at {d['batch']:,} in flight",
            f"  decode        {d['tokens_per_s_per_gpu']:,.0f} output tokens/s per GPU",
            f"  pools         {r['decode_gpus_per_prefill_gpu']:.2f} decode GPUs per prefill GPU",
            _memory_line(d["memory"]),
            f"bottleneck: {r['bottleneck']}",
        ]
    lines = [
        f"{spec.model.name} on {gpu}: {_plan_text(r['plan'])}",
        f"{r['mode']}: prompt {cfg.prompt_len:,}, output {cfg.output_len:,} tokens",
    ]
    if r["mode"] == "serving":
        lines.append(f"  in flight     {r['batch']:,} sequences (set by {r['batch_limited_by']})")
    else:
        lines.append(f"  batch         {r['batch']:,} sequences, prefill {r['prefill_s']:.3f} s")
    per_req = r["tokens_per_s_per_request"]
    lines += [
        f"  TTFT          {r['ttft_s'] * 1e3:,.0f} ms",
        f"  TPOT          {r['tpot_s'] * 1e3:.1f} ms ({per_req:.1f} tokens/s per request)",
        f"  throughput    {r['tokens_per_s_per_gpu']:,.0f} output tokens/s per GPU",
        _memory_line(r["memory"]),
        f"bottleneck: {r['bottleneck']}",
    ]
    return lines


def _search(spec: RunSpec, cfg: InferenceConfig, gpus: int, top: int, json_out: bool) -> None:
    from aihpc.perf.infer.config import serving_load, serving_plan
    from aihpc.perf.infer.search import search_serving

    if cfg.tpot_ms is None and cfg.ttft_ms is None:
        raise SpecError("--tpot-ms", None, "a latency target is required with --search")
    res = search_serving(
        spec.model,
        spec.cluster,
        gpus,
        serving_load(cfg),
        serving_plan(cfg),
        tpot_ms=cfg.tpot_ms,
        ttft_ms=cfg.ttft_ms,
    )
    if json_out:
        print_json(
            {"targets": {"tpot_ms": cfg.tpot_ms, "ttft_ms": cfg.ttft_ms}, **res.to_json(top)}
        )
        return
    target = ", ".join(
        f"{k} <= {v:g} ms" for k, v in (("TPOT", cfg.tpot_ms), ("TTFT", cfg.ttft_ms)) if v
    )
    typer.echo(
        f"{spec.model.name} on up to {gpus} x {spec.cluster.gpu.name}, prompt "
        f"{cfg.prompt_len:,} / output {cfg.output_len:,}, {target}: {len(res.ranked)} of "
        f"{res.priced} plans meet it ({res.missed_target} miss it, {res.not_fitting} do not fit)"
    )
    if not res.ranked:
        return
    typer.echo(f"{'rank':>4}  {'plan':<58} {'in flight':>9} {'TPOT ms':>8} {'TTFT ms':>8} "
               f"{'tok/s/GPU':>9}")  # fmt: skip
    for i, est in enumerate(res.ranked[:top]):
        typer.echo(
            f"{i + 1:>4}  {_plan_text(est.plan.to_json()):<58} {est.batch:>9,} "
            f"{est.tpot_s * 1e3:>8.1f} {est.ttft_s * 1e3:>8.0f} {est.tokens_per_s_per_gpu:>9,.0f}"
        )
