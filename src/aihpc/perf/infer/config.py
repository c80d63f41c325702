"""A run spec's ``[inference]`` table: what ``aihpc infer`` prices, checked field by field.

    [inference]
    mode = "serving"          # static | serving | disaggregated
    prompt_len = 1024
    output_len = 256
    batch = 64                # static: the batch; serving: in flight (absent: what fits)
    tp = 8
    kv_dtype = "fp8"
    tpot_ms = 50              # targets for `aihpc infer --search`

docs/run-spec.md lists every field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from aihpc.perf.infer.kv import DTYPE_BYTES, KV_DTYPES, ServingPlan
from aihpc.perf.infer.serving import Load
from aihpc.runspec.errors import SpecError

__all__ = ["MODES", "InferenceConfig", "inference_from_table"]

MODES = ("static", "serving", "disaggregated")


@dataclass(frozen=True)
class InferenceConfig:
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
    # disaggregated: the prefill pool's plan (the decode pool is tp / pp / dp / ep above)
    prefill_tp: int = 1
    prefill_dp: int = 1
    prefill_ep: int = 1
    # targets for the search over serving plans
    tpot_ms: float | None = None
    ttft_ms: float | None = None

    def plan(self) -> ServingPlan:
        return ServingPlan(
            self.tp, self.pp, self.dp, self.ep, self.kv_dtype, self.weight_dtype, self.block_size
        )

    def prefill_plan(self) -> ServingPlan:
        return ServingPlan(
            tp=self.prefill_tp,
            dp=self.prefill_dp,
            ep=self.prefill_ep,
            kv_dtype=self.kv_dtype,
            weight_dtype=self.weight_dtype,
            block_size=self.block_size,
        )

    def load(self) -> Load:
        return Load(
            prompt_len=self.prompt_len,
            output_len=self.output_len,
            max_seqs=self.max_seqs,
            max_batched_tokens=self.max_batched_tokens,
            chunked_prefill=self.chunked_prefill,
            prefix_hit=self.prefix_hit,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_free_fraction=self.kv_free_fraction,
            reserve_full=self.reserve_full,
        )

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


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
_FRACTIONS = ("gpu_memory_utilization", "kv_free_fraction")


def _check(name: str, value: Any) -> None:
    where = f"inference.{name}"
    if name in _COUNTS:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SpecError(where, value, "a whole number >= 1")
    elif name in _FRACTIONS:
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
            raise SpecError(where, value, "a fraction in (0, 1]")
    elif name == "prefix_hit":
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
            raise SpecError(where, value, "a fraction in [0, 1)")
    elif name in ("tpot_ms", "ttft_ms"):
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or value <= 0:
            raise SpecError(where, value, "milliseconds > 0")
    elif name in ("chunked_prefill", "reserve_full"):
        if not isinstance(value, bool):
            raise SpecError(where, value, "true or false")
    elif name == "mode" and value not in MODES:
        raise SpecError(where, value, "one of " + ", ".join(MODES))
    elif name == "kv_dtype" and value not in KV_DTYPES:
        raise SpecError(where, value, "one of " + ", ".join(KV_DTYPES))
    elif name == "weight_dtype" and value not in DTYPE_BYTES:
        raise SpecError(where, value, "one of " + ", ".join(DTYPE_BYTES))


def inference_from_table(
    table: dict[str, Any], overrides: dict[str, Any] | None = None
) -> InferenceConfig:
    """``[inference]`` (and command-line ``overrides``, None values skipped) -> the config;
    an unknown field or a bad value is one SpecError naming it."""
    if not isinstance(table, dict):
        raise SpecError("inference", table, "expected a table")
    known = {f.name for f in fields(InferenceConfig)}
    given = {**table, **{k: v for k, v in (overrides or {}).items() if v is not None}}
    for name, value in given.items():
        if name not in known:
            raise SpecError(
                f"inference.{name}", value, "unknown field; allowed: " + ", ".join(sorted(known))
            )
        _check(name, value)
    return replace(InferenceConfig(), **given)
