"""ModelSpec: *what* is trained — a dense or mixture-of-experts decoder-only transformer."""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, replace
from functools import cache
from importlib import resources
from typing import Any

from aihpc.runspec._table import check_choice, check_positive, from_table, lookup_name
from aihpc.runspec.errors import SpecError

__all__ = ["FFN_ACTIVATIONS", "ModelSpec", "model_from_table", "model_presets"]

FFN_ACTIVATIONS = ("gelu", "swiglu", "relu2")


@dataclass(frozen=True)
class ModelSpec:
    """Transformer shape. Field names are the run-spec contract (docs RUN_SPEC.md)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int
    num_kv_heads: int | None = None  # None: multi-head attention (= num_attention_heads)
    ffn_activation: str = "gelu"
    tied_embeddings: bool = False
    position_embedding: str = "rope"  # rope | learned (GPT-2/3 absolute positions)
    # RoPE's base (theta): Llama 3's 500000; 10000 is RoFormer's and Megatron-LM's default.
    rope_theta: float = 10000.0
    head_dim: int | None = None  # None: hidden_size / num_attention_heads
    # Sliding-window attention (Mistral 7B v0.1, Gemma 2/3, GPT-OSS): a windowed layer's query
    # attends to itself and the attention_window - 1 tokens before it; None: every layer full.
    attention_window: int | None = None
    # With attention_window: every n-th layer (the n-th, 2n-th, ...) attends to the whole
    # sequence (Megatron-Core's window_attn_skip_freq; GPT-OSS 2, Gemma 3 6); 0: every layer
    # is windowed.
    full_attention_every: int = 0
    # Mixture of experts; num_experts = 0 is dense.
    num_experts: int = 0
    moe_top_k: int = 0
    moe_ffn_hidden_size: int | None = None
    num_shared_experts: int = 0
    first_dense_layers: int = 0
    # Every n-th layer after the first dense ones is MoE (Megatron-Core moe_layer_freq; Llama 4
    # Maverick interleaves dense and MoE layers: 2); 1: all of them.
    moe_layer_freq: int = 1
    # Tokens an expert may take, as a multiple of the balanced share; None: dropless (no cap).
    moe_capacity_factor: float | None = None
    # Group-limited routing (DeepSeek-V3's node-limited routing: experts in n_group groups, a
    # token's top-k drawn from its best topk_group groups); 0: none.
    moe_router_groups: int = 0
    moe_router_group_topk: int = 0
    # Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2); kv_lora_rank None: standard attention.
    q_lora_rank: int | None = None  # None: queries projected directly (no low-rank q)
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    # Multi-token prediction modules (DeepSeek-V3: 1), each one transformer layer plus an output.
    mtp_layers: int = 0
    # Router (what the trainer's MoE block does; Megatron-Core's names).
    moe_router_score_function: str = "softmax"  # softmax (Mixtral, Qwen3) | sigmoid (DeepSeek-V3)
    moe_router_topk_scaling_factor: float = 1.0  # DeepSeek-V3: 2.5
    moe_router_bias_update_rate: float = 0.0  # aux-loss-free balancing; DeepSeek-V3: 0.001
    moe_aux_loss_coeff: float = 0.0  # sequence-wise balance loss; DeepSeek-V3: 0.0001
    name: str = "custom"
    source: str = ""

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_attention()
        self._check_moe()

    def _check_numbers(self) -> None:
        """Counts and sizes: finite and > 0 (>= 0 where 0 means none)."""
        for f in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "ffn_hidden_size",
            "vocab_size",
            "seq_length",
            "num_kv_heads",
            "head_dim",
            "moe_layer_freq",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "moe_capacity_factor",
            "attention_window",
        ):
            check_positive(f"model.{f}", getattr(self, f))
        cf = self.moe_capacity_factor
        if cf is not None and not math.isfinite(cf):
            raise SpecError("model.moe_capacity_factor", cf, "a finite number > 0, or unset")
        for f in (
            "moe_router_groups",
            "moe_router_group_topk",
            "mtp_layers",
            "full_attention_every",
            "num_experts",
            "moe_top_k",
            "num_shared_experts",
            "first_dense_layers",
            "moe_router_bias_update_rate",
            "moe_aux_loss_coeff",
        ):
            check_positive(f"model.{f}", getattr(self, f), allow_zero=True)
        check_positive("model.moe_router_topk_scaling_factor", self.moe_router_topk_scaling_factor)
        check_positive("model.rope_theta", self.rope_theta)
        if not math.isfinite(self.rope_theta):
            raise SpecError("model.rope_theta", self.rope_theta, "a finite number > 0")

    def _check_attention(self) -> None:
        """Heads, MLA's dimensions, the sliding window, activation and positions."""
        if self.full_attention_every and self.attention_window is None:
            raise SpecError(
                "model.full_attention_every", self.full_attention_every, "needs attention_window"
            )
        if self.kv_lora_rank is not None:
            for f in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, f) is None:
                    raise SpecError(f"model.{f}", None, "required with kv_lora_rank (MLA)")
        elif self.q_lora_rank is not None:
            raise SpecError("model.q_lora_rank", self.q_lora_rank, "needs kv_lora_rank (MLA)")
        check_choice("model.ffn_activation", self.ffn_activation, FFN_ACTIVATIONS)
        check_choice("model.position_embedding", self.position_embedding, ("rope", "learned"))
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise SpecError(
                "model.num_attention_heads",
                self.num_attention_heads,
                f"must divide hidden_size {self.hidden_size} (or set model.head_dim)",
            )
        if self.num_attention_heads % self.kv_heads:
            raise SpecError(
                "model.num_kv_heads",
                self.num_kv_heads,
                f"must divide num_attention_heads {self.num_attention_heads}",
            )

    def _check_moe(self) -> None:
        """The router and the experts' layout."""
        scores = self.moe_router_score_function
        check_choice("model.moe_router_score_function", scores, ("softmax", "sigmoid"))
        if not self.num_experts:
            return
        if not 1 <= self.moe_top_k <= self.num_experts:
            raise SpecError(
                "model.moe_top_k",
                self.moe_top_k,
                f"must be between 1 and num_experts {self.num_experts}",
            )
        if self.moe_router_groups and (
            self.num_experts % self.moe_router_groups
            or not 1 <= self.moe_router_group_topk <= self.moe_router_groups
        ):
            raise SpecError(
                "model.moe_router_groups",
                self.moe_router_groups,
                "must divide num_experts, with 1 <= moe_router_group_topk <= it",
            )
        if self.first_dense_layers >= self.num_layers:
            raise SpecError(
                "model.first_dense_layers",
                self.first_dense_layers,
                f"must be below num_layers {self.num_layers}",
            )

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def kv_channels(self) -> int:
        """Per-head dimension."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def num_moe_layers(self) -> int:
        """MoE layers: after ``first_dense_layers``, one in every ``moe_layer_freq``."""
        if not self.is_moe:
            return 0
        return (self.num_layers - self.first_dense_layers) // self.moe_layer_freq

    @property
    def windowed_layers(self) -> int:
        """Layers with sliding-window attention: all but every ``full_attention_every``-th."""
        if self.attention_window is None:
            return 0
        every = self.full_attention_every
        return self.num_layers - (self.num_layers // every if every else 0)

    @property
    def expert_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size


@cache
def model_presets() -> dict[str, dict[str, Any]]:
    """Preset tables from ``runspec/data/models.toml`` (every number there has a source)."""
    text = resources.files("aihpc.runspec").joinpath("data/models.toml").read_text()
    return tomllib.loads(text)


def model_from_table(table: dict[str, Any]) -> ModelSpec:
    """``[model]`` table → ModelSpec; ``preset = "id"`` starts from a preset, fields override."""
    table = dict(table)
    preset = table.pop("preset", None)
    if preset is None:
        return from_table(ModelSpec, table, "model")
    preset = lookup_name("model.preset", preset, model_presets())  # "Llama3-70B" is "llama3-70b"
    base = {"name": preset, **model_presets()[preset]}
    spec = from_table(ModelSpec, {**base, **table}, "model")
    # An edited preset is no longer the published model; fields set to the preset's own values
    # (or to the defaults it leaves) do not edit it.
    if "name" not in table and spec != from_table(ModelSpec, base, "model"):
        spec = replace(spec, name=f"{preset} (modified)")
    return spec
