"""InferenceSpec: a run spec's ``[inference]`` table, what ``aihpc infer`` prices: one static
batch, steady-state serving, or disaggregated prefill and decode pools, on a serving plan
(TP / PP / attention DP / EP), with the engine's memory and scheduling settings and, for the
search, latency targets. The planner's perf/infer/ reads it; docs/inference.md explains it."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from aihpc.runspec._table import check_choice, from_table
from aihpc.runspec.errors import SpecError

__all__ = [
    "INFERENCE_MODES",
    "KV_DTYPES",
    "WEIGHT_DTYPES",
    "InferenceSpec",
    "inference_from_table",
]

INFERENCE_MODES = ("static", "serving", "disaggregated")
KV_DTYPES = ("bf16", "fp16", "fp8", "fp32")  # fp32: a CPU host computing in fp32
WEIGHT_DTYPES = ("bf16", "fp16", "fp8", "int8", "int4", "fp32")
_COUNTS = (
    "prompt_len",
    "output_len",
    "batch",
    "tp",
    "pp",
    "dp",
    "ep",
    "block_size",
    "max_seqs",
    "max_batched_tokens",
    "prefill_tp",
    "prefill_dp",
    "prefill_ep",
)


@dataclass(frozen=True)
class InferenceSpec:
    mode: str = "serving"
    prompt_len: int = 1024
    output_len: int = 256
    batch: int | None = None
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    kv_dtype: str = "bf16"
    weight_dtype: str = "bf16"
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_free_fraction: float | None = None
    reserve_full: bool = False
    max_seqs: int | None = None
    max_batched_tokens: int = 8192
    chunked_prefill: bool = True
    prefix_hit: float = 0.0
    prefill_tp: int = 1
    prefill_dp: int = 1
    prefill_ep: int = 1
    tpot_ms: float | None = None
    ttft_ms: float | None = None
    engine: str = "default"
    moe_imbalance: float = 1.0

    def __post_init__(self) -> None:
        for name in _COUNTS:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise SpecError(f"inference.{name}", value, "a whole number >= 1")
        for name in ("gpu_memory_utilization", "kv_free_fraction"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and 0 < value <= 1):
                raise SpecError(f"inference.{name}", value, "a fraction in (0, 1]")
        if not (math.isfinite(self.moe_imbalance) and self.moe_imbalance >= 1):
            raise SpecError("inference.moe_imbalance", self.moe_imbalance, "a number >= 1")
        if not isinstance(self.engine, str):
            raise SpecError("inference.engine", self.engine, "an engine name (docs/inference.md)")
        if not (math.isfinite(self.prefix_hit) and 0 <= self.prefix_hit < 1):
            raise SpecError("inference.prefix_hit", self.prefix_hit, "a fraction in [0, 1)")
        for name in ("tpot_ms", "ttft_ms"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise SpecError(f"inference.{name}", value, "milliseconds > 0")
        check_choice("inference.mode", self.mode, INFERENCE_MODES)
        check_choice("inference.kv_dtype", self.kv_dtype, KV_DTYPES)
        check_choice("inference.weight_dtype", self.weight_dtype, WEIGHT_DTYPES)

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def inference_from_table(
    table: dict[str, Any], overrides: dict[str, Any] | None = None
) -> InferenceSpec:
    """``[inference]`` (and command-line ``overrides``, None values skipped) -> the spec; an
    unknown field or a bad value is one SpecError naming it."""
    if not isinstance(table, dict):
        raise SpecError("inference", table, "expected a table")
    given = {**table, **{k: v for k, v in (overrides or {}).items() if v is not None}}
    return from_table(InferenceSpec, given, "inference")
