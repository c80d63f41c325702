"""``aihpc presets`` and ``aihpc gpus``: the names a run spec may use, with their key figures and
sources, so a user never has to read the data files to write ``preset = ...`` or ``gpu = ...``."""

from __future__ import annotations

import re
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from aihpc.cli._common import console, guarded, print_json

__all__ = ["gpu_rows", "preset_rows", "register"]


def _short_source(text: str) -> str:
    """The citation's head ("Touvron et al. 2023"), for a table; --json has the whole text."""
    head = re.split(r"[,;(]| - ", text, maxsplit=1)[0].strip()
    return head.rstrip(":") or text


def preset_rows() -> list[dict[str, Any]]:
    """Every model preset as it resolves (the ModelSpec fields) with its parameter count."""
    from aihpc.perf.step.flops import active_params, num_params
    from aihpc.runspec import model_presets
    from aihpc.runspec.model import model_from_table

    rows = []
    for name in sorted(model_presets()):
        m = model_from_table({"preset": name})
        rows.append(
            {
                "preset": name,
                "params": num_params(m),
                "active_params": active_params(m),
                "num_layers": m.num_layers,
                "hidden_size": m.hidden_size,
                "num_attention_heads": m.num_attention_heads,
                "num_kv_heads": m.kv_heads,
                "ffn_hidden_size": m.ffn_hidden_size,
                "ffn_activation": m.ffn_activation,
                "vocab_size": m.vocab_size,
                "seq_length": m.seq_length,
                "num_experts": m.num_experts,
                "moe_top_k": m.moe_top_k,
                # the routed experts' FFN width (the dense layers' is ffn_hidden_size)
                "expert_ffn_hidden_size": m.expert_ffn_hidden_size if m.is_moe else None,
                "num_shared_experts": m.num_shared_experts,
                "dense_layers": m.num_layers - m.num_moe_layers,  # what ffn_hidden_size is for
                "source": m.source,
            }
        )
    return rows


def gpu_rows() -> list[dict[str, Any]]:
    """Every GPU of the catalog with its peaks, memory and links (GPUSpec fields)."""
    from aihpc.runspec import gpu_catalog
    from aihpc.runspec._table import to_table
    from aihpc.runspec.cluster import gpu_from_id

    return [{"gpu": gid, **to_table(gpu_from_id(gid))} for gid in sorted(gpu_catalog())]


def _count(n: int) -> str:
    return f"{n / 1e9:,.2f} B" if n >= 1e8 else f"{n:,}"


def _experts(r: dict[str, Any]) -> str:
    """The routed experts and their own FFN width (the ffn column is the dense layers'), top-k,
    and the shared experts: "256 x 2,048 top 8 +1"."""
    if not r["num_experts"]:
        return "-"
    shared = f" +{r['num_shared_experts']}" if r["num_shared_experts"] else ""
    return f"{r['num_experts']} x {r['expert_ffn_hidden_size']:,} top {r['moe_top_k']}{shared}"


def _num(value: float | None, fmt: str = ",.0f") -> str:
    return "-" if value is None else format(value, fmt)


def register(app: typer.Typer) -> None:
    @app.command()
    @guarded
    def presets(
        json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    ) -> None:
        r"""List the model presets (\[model] preset = "...") with their shapes and sources."""
        from aihpc.cli.vlm import vlm_preset_rows, vlm_presets_table

        rows = preset_rows()
        vlm_rows = vlm_preset_rows()
        if json_out:
            print_json({"presets": rows, "vlm_presets": vlm_rows})
            return
        t = Table(title=escape("Model presets: [model] preset = NAME"), show_edge=False)
        cols = ("preset", "params", "active", "layers", "hidden", "heads", "kv", "ffn", "vocab")
        for col in (*cols, "seq", "experts x ffn", "source"):
            t.add_column(col, justify="left" if col in ("preset", "source") else "right")
        for r in rows:
            t.add_row(
                r["preset"],
                _count(r["params"]),
                _count(r["active_params"]) if r["num_experts"] else "-",
                str(r["num_layers"]),
                f"{r['hidden_size']:,}",
                str(r["num_attention_heads"]),
                str(r["num_kv_heads"]),
                f"{r['ffn_hidden_size']:,}" if r["dense_layers"] else "-",
                f"{r['vocab_size']:,}",
                f"{r['seq_length']:,}",
                _experts(r),
                escape(_short_source(r["source"])),
            )
        console.print(t)
        console.print(vlm_presets_table(vlm_rows), highlight=False)
        console.print("Full sources: aihpc presets --json", highlight=False)

    @app.command()
    @guarded
    def gpus(
        json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    ) -> None:
        r"""List the GPU catalog (\[cluster] gpu = "...") with peaks, memory, links and sources."""
        rows = gpu_rows()
        if json_out:
            print_json({"gpus": rows})
            return
        title = "GPU catalog: [cluster] gpu = NAME (dense TFLOP/s, GB/s per direction)"
        t = Table(title=escape(title), show_edge=False)
        heads = ("gpu", "name", "bf16", "fp8", "HBM GiB", "HBM GB/s", "scale-up", "domain")
        for col in (*heads, "scale-out", "source"):
            t.add_column(col, justify="left" if col in ("gpu", "name", "source") else "right")
        for r in rows:
            t.add_row(
                r["gpu"],
                escape(r["name"]),
                _num(r["bf16_tflops"]),
                _num(r["fp8_tflops"]),
                _num(r["hbm_gib"], ",.1f"),
                _num(r["hbm_bw_GBps"]),
                _num(r["scale_up_bw_GBps"]),
                str(r["scale_up_domain"]),
                _num(r["scale_out_bw_GBps"]),
                escape(_short_source(r["source"])),
            )
        console.print(t)
        console.print("Names match in any case; full sources: aihpc gpus --json", highlight=False)
