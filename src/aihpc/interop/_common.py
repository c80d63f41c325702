"""What the three framework converters share: the imported run spec with its warnings, the model
table (a preset when the shape is one), and the fields a framework fixes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from aihpc.runspec import ModelSpec, RunSpec, SpecError, model_presets, runspec_from_dict
from aihpc.runspec._table import from_table
from aihpc.runspec.model import model_from_table
from aihpc.runspec.tomlw import dumps_toml

__all__ = ["Imported", "model_fields", "model_table", "not_carried", "packed_bin_sequences"]

_SKIP = ("name", "source")


@dataclass
class Imported:
    """A run spec read from a framework's config: its tables, the source fields aihpc cannot
    price (named as the source names them) and the assumptions made (defaults, options)."""

    framework: str
    tables: dict[str, dict[str, Any]]
    unpriced: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def spec(self) -> RunSpec:
        """The validated run spec (SpecError names the field if the source breaks a rule)."""
        spec = runspec_from_dict(self.tables)
        spec.plan()
        return spec

    def toml(self, source: str) -> str:
        header = f"run spec imported by `aihpc import` from {self.framework} config {source}"
        lines = [header]
        lines += [f"note: {n}" for n in self.notes]
        if self.unpriced:
            lines.append("not priced (set in the source): " + ", ".join(self.unpriced))
        return dumps_toml(self.tables, "\n".join(lines))


def model_fields(model: ModelSpec) -> dict[str, Any]:
    """The shape of ``model``, without its name and source (no ``num_kv_heads`` is as many KV
    heads as query heads: the same model)."""
    out = {f.name: getattr(model, f.name) for f in fields(model) if f.name not in _SKIP}
    out["num_kv_heads"] = model.kv_heads
    return out


def model_table(shape: dict[str, Any]) -> dict[str, Any]:
    """The ``[model]`` table for ``shape``: ``preset = id`` when it is a preset's shape (the
    sequence length and vocabulary may differ), else every field that differs from ModelSpec's
    defaults."""
    spec = from_table(ModelSpec, shape, "model")
    mine = model_fields(spec)
    near = []
    for preset in model_presets():
        theirs = model_fields(model_from_table({"preset": preset}))
        diff = {k: v for k, v in mine.items() if theirs[k] != v}
        if not diff:
            return {"preset": preset}
        if set(diff) <= {"seq_length", "vocab_size"}:  # Megatron pads the vocabulary
            near.append({"preset": preset, **diff})
    if near:
        return min(near, key=len)
    defaults = ModelSpec(1, 1, 1, 1, 1, 1)
    keep = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size")
    return {
        k: v for k, v in mine.items() if k in (*keep, "seq_length") or getattr(defaults, k) != v
    }


def not_carried(spec: RunSpec, fixed: dict[str, Any], framework: str) -> list[str]:
    """``[training]`` fields whose value ``framework`` cannot take: it runs ``fixed`` instead."""
    out = []
    for name, value in fixed.items():
        if name == "fp8_saved_inputs" and spec.training.precision != "fp8":
            continue  # read only by FP8 runs
        mine = getattr(spec.training, name)
        if mine != value:
            out.append(f"training.{name} = {mine!r} ({framework} runs {value!r})")
    return out


def cluster_table(gpu: str, num_gpus: int, gpus_per_node: int | None) -> dict[str, Any]:
    table: dict[str, Any] = {"gpu": gpu, "num_gpus": num_gpus}
    if gpus_per_node is not None:
        table["gpus_per_node"] = gpus_per_node
    return table


def require(value: Any, field_name: str, allowed: str) -> Any:
    if value is None:
        raise SpecError(field_name, None, allowed)
    return value


def as_int(value: Any, field_name: str) -> int:
    try:
        out = int(str(value))
    except ValueError:
        raise SpecError(field_name, value, "expected an integer") from None
    return out


def as_float(value: Any, field_name: str) -> float:
    try:
        out = float(str(value))
    except ValueError:
        raise SpecError(field_name, value, "expected a number") from None
    if not math.isfinite(out):
        raise SpecError(field_name, value, "expected a finite number")
    return out


def packed_bin_sequences(
    tokens_per_gpu: int, parallel: dict[str, Any], gpus: int, seq: int, notes: list[str]
) -> int:
    """A framework's token-capped dynamic micro-batch (verl's ``ppo_max_token_len_per_gpu``,
    slime's ``--max-tokens-per-gpu``; each GPU of a context-parallel group holds its share of a
    sequence, so the cap is times the context degree) as the planner's packed bins
    (``rl.batching = "packed"``, bins of micro_batch_size x ``seq`` tokens): the largest count
    of ``seq``-token sequences within the cap that divides a data-parallel rank's share of the
    optimizer step (``parallel``'s global batch over ``gpus``), as the plan's micro-batches
    must; a note says so."""
    cp = parallel.get("cp", 1)
    tokens = tokens_per_gpu * cp
    dp = max(1, gpus // (parallel.get("tp", 1) * parallel.get("pp", 1) * cp))
    share = max(1, parallel["global_batch_size"] // dp)
    fits = max(1, tokens // seq)
    mbs = max(m for m in range(1, fits + 1) if share % m == 0)
    notes.append(
        f"dynamic micro-batches of up to {tokens} tokens priced as packed bins of {mbs} x {seq} "
        "(prompt + response caps)"
    )
    return mbs
