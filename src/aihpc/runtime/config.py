"""The runtime's model configuration, from the run spec's [model] table, without torch: the
launcher checks a spec with these before any worker (and before torch's model code) is loaded.
``aihpc.runtime.model`` and ``aihpc.runtime.moe`` re-export them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aihpc.runspec import ModelSpec, SpecError
from aihpc.runspec._table import check_choice
from aihpc.runspec.rules import trainer_model_refusal

__all__ = [
    "EXPERT_COMPUTE",
    "ROUTER_SCORES",
    "LlamaConfig",
    "MoEConfig",
    "moe_config_from_spec",
]

ROUTER_SCORES = ("softmax", "sigmoid")
EXPERT_COMPUTE = ("auto", "loop", "grouped_mm")


@dataclass(frozen=True)
class MoEConfig:
    dim: int
    num_experts: int
    top_k: int
    expert_ffn_dim: int
    num_shared_experts: int = 0
    score_func: str = "softmax"
    route_norm: bool = True
    route_scale: float = 1.0
    bias_update_rate: float = 0.0  # 0: no aux-loss-free balancing (DeepSeek-V3 used 0.001)
    aux_loss_coeff: float = 0.0  # 0: no sequence-wise balance loss (DeepSeek-V3 used 0.0001)
    num_groups: int = 1  # group-limited routing: groups of experts (1: off)
    topk_groups: int = 1  # groups a token may use
    first_dense_layers: int = 0
    layer_freq: int = 1  # layer i >= first_dense_layers is MoE when i % layer_freq == 0
    expert_compute: str = "auto"
    # token dropping: an expert takes at most ceil(capacity_factor x seq x top_k / experts)
    # tokens of each sequence, its highest-scored ones (moe.py); None: dropless
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        check_choice("model.moe_router_score_function", self.score_func, ROUTER_SCORES)
        check_choice("expert_compute", self.expert_compute, EXPERT_COMPUTE)
        if not 1 <= self.top_k <= self.num_experts:
            raise SpecError(
                "model.moe_top_k", self.top_k, f"must be between 1 and {self.num_experts}"
            )
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise SpecError(
                "model.moe_router_groups",
                self.num_groups,
                f"must divide num_experts {self.num_experts}",
            )
        if not 1 <= self.topk_groups <= self.num_groups:
            raise SpecError(
                "model.moe_router_group_topk", self.topk_groups, f"1 to {self.num_groups}"
            )
        if self.topk_groups * self.num_experts // self.num_groups < self.top_k:
            raise SpecError(
                "model.moe_router_group_topk",
                self.topk_groups,
                f"its groups hold fewer than moe_top_k {self.top_k} experts",
            )
        if self.layer_freq < 1:
            raise SpecError("model.moe_layer_freq", self.layer_freq, "must be >= 1")

    def is_moe_layer(self, layer_id: int) -> bool:
        """HF DeepSeek's rule: first_k_dense_replace dense layers, then every moe_layer_freq-th."""
        return layer_id >= self.first_dense_layers and layer_id % self.layer_freq == 0


def moe_config_from_spec(spec: ModelSpec) -> MoEConfig | None:
    """The block's configuration from the run spec's [model] table (None for a dense model).

    Router fields the spec may not define yet are read with their defaults (softmax, no
    balancing, no group limit, every layer after the first dense ones).
    """
    if not spec.is_moe:
        return None

    def opt(name: str, default: Any) -> Any:
        value = getattr(spec, name, None)
        return default if value is None else value

    return MoEConfig(
        dim=spec.hidden_size,
        num_experts=spec.num_experts,
        top_k=spec.moe_top_k,
        expert_ffn_dim=spec.expert_ffn_hidden_size,
        num_shared_experts=spec.num_shared_experts,
        score_func=opt("moe_router_score_function", "softmax"),
        route_scale=float(opt("moe_router_topk_scaling_factor", 1.0)),
        bias_update_rate=float(opt("moe_router_bias_update_rate", 0.0)),
        aux_loss_coeff=float(opt("moe_aux_loss_coeff", 0.0)),
        # the spec's 0 groups (no group limit) is the block's one group holding every expert
        num_groups=int(opt("moe_router_groups", 0)) or 1,
        topk_groups=int(opt("moe_router_group_topk", 0)) or 1,
        first_dense_layers=spec.first_dense_layers,
        layer_freq=int(opt("moe_layer_freq", 1)),
        capacity_factor=spec.moe_capacity_factor,
    )


@dataclass(frozen=True)
class LlamaConfig:
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int
    tied_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    moe: MoEConfig | None = None  # mixture of experts: which layers, router, experts (moe.py)

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> LlamaConfig:
        """The runtime trains SwiGLU decoders, dense or MoE; other ModelSpec shapes are refused
        (``aihpc.runspec.rules.trainer_model_refusal``, the rule ``aihpc search`` marks by)."""
        problem = trainer_model_refusal(spec)
        if problem is not None:
            raise problem
        return cls(
            dim=spec.hidden_size,
            num_layers=spec.num_layers,
            num_heads=spec.num_attention_heads,
            num_kv_heads=spec.kv_heads,
            ffn_dim=spec.ffn_hidden_size,
            vocab_size=spec.vocab_size,
            max_seq_len=spec.seq_length,
            tied_embeddings=spec.tied_embeddings,
            rope_theta=spec.rope_theta,
            moe=moe_config_from_spec(spec),
        )
