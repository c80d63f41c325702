"""Parameter counts and FLOPs of a decoder-only transformer.

FLOP convention (fixed, stated in docs/performance-model.md): a multiply-add is 2 FLOPs; the
backward pass costs twice the forward; **causal attention is counted in full** (the s x s score
matrix, as in Megatron-LM's 72·B·s·L·h²·(1 + s/6h + V/12Lh) formula of Korthikanti et al. 2022 and
torchtitan's 6N + 12·L·h·s), so model FLOPs, MFU and the published TFLOP/s of the validation rows
share one basis. What the GPU actually executes (``executed``) halves the attention core for a
causal FlashAttention kernel, which skips the masked blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from aihpc.runspec.model import ModelSpec

__all__ = [
    "LayerFlops",
    "counted_keys",
    "layer_flops",
    "logits_flops",
    "model_flops_per_token",
    "num_params",
    "params_per_layer",
]


def _ffn_in(model: ModelSpec, ffn: int) -> int:
    """Width of the first FFN projection: gated units (SwiGLU) have gate + up."""
    return 2 * ffn if model.ffn_activation == "swiglu" else ffn


def attention_params(model: ModelSpec) -> int:
    if model.is_mla:
        return sum(n_in * n_out for _, n_in, n_out, _ in mla_gemms(model)) + mla_norms(model)
    d = model.kv_channels
    q = model.num_attention_heads * d
    kv = model.kv_heads * d
    return model.hidden_size * (q + 2 * kv) + q * model.hidden_size


def mla_head_dims(model: ModelSpec) -> tuple[int, int]:
    """(query/key width, value width) per head of multi-head latent attention."""
    assert model.qk_nope_head_dim and model.qk_rope_head_dim and model.v_head_dim
    return model.qk_nope_head_dim + model.qk_rope_head_dim, model.v_head_dim


def mla_gemms(model: ModelSpec) -> list[tuple[str, int, int, str]]:
    """Multi-head latent attention's projections as (name, in, out, split), DeepSeek-V3's layout
    (arXiv 2412.19437 sec. 2.1.1; Megatron-Core's MLASelfAttention): the down projections of
    the query (to q_lora_rank) and of the joint key-value latent plus the shared RoPE key (to
    kv_lora_rank + qk_rope_head_dim) are replicated over TP ranks ("rep"), the up projections
    split their output ("col") and the output projection its input ("row")."""
    h, a = model.hidden_size, model.num_attention_heads
    dqk, dv = mla_head_dims(model)
    assert model.kv_lora_rank is not None and model.qk_nope_head_dim and model.qk_rope_head_dim
    out: list[tuple[str, int, int, str]] = []
    if model.q_lora_rank:
        q = model.q_lora_rank
        out += [("q_down", h, q, "rep"), ("q_up", q, a * dqk, "col")]
    else:
        out += [("q", h, a * dqk, "col")]
    out += [
        ("kv_down", h, model.kv_lora_rank + model.qk_rope_head_dim, "rep"),
        ("kv_up", model.kv_lora_rank, a * (model.qk_nope_head_dim + dv), "col"),
        ("o", a * dv, h, "row"),
    ]
    return out


def mla_norms(model: ModelSpec) -> int:
    """RMSNorm weights on the query and key-value latents."""
    return (model.q_lora_rank or 0) + (model.kv_lora_rank or 0)


def expert_params_per_layer(model: ModelSpec) -> int:
    """Routed experts' weights of one MoE layer (what expert parallelism splits)."""
    return model.num_experts * mlp_params(model, model.expert_ffn_hidden_size)


def mtp_params(model: ModelSpec) -> int:
    """Multi-token prediction modules (DeepSeek-V3 sec. 2.2): one transformer layer (an MoE layer
    in an MoE model), a 2h -> h projection and two RMSNorms each; embedding and output head are
    shared with the main model. DeepSeek-V3's 671B excludes them (its 14B MTP module)."""
    h = model.hidden_size
    per = params_per_layer(model, model.is_moe) + 2 * h * h + 2 * h
    return model.mtp_layers * per


def mlp_params(model: ModelSpec, ffn: int) -> int:
    return model.hidden_size * _ffn_in(model, ffn) + ffn * model.hidden_size


@cache  # pure, and called for every plan the search evaluates
def params_per_layer(model: ModelSpec, moe: bool = False) -> int:
    """Weights of one layer (norm weights included; biases are not used by modern models and are
    <0.1% for GPT-style ones)."""
    norms = 2 * model.hidden_size
    if moe:
        experts = model.num_experts + model.num_shared_experts
        router = model.hidden_size * model.num_experts
        return (
            attention_params(model)
            + experts * mlp_params(model, model.expert_ffn_hidden_size)
            + router
            + norms
        )
    return attention_params(model) + mlp_params(model, model.ffn_hidden_size) + norms


def param_tensors_per_layer(model: ModelSpec) -> int:
    """Parameter tensors of one layer as Megatron-LM lays them out (what a per-tensor ZeRO-3
    gathers one by one): fused QKV, attention output, FFN in (gate and up fused), FFN out; GPT-style
    models (learned positions) add a bias to each and LayerNorm weight + bias, Llama-style ones
    have no biases and RMSNorm weights only."""
    if model.position_embedding == "learned":
        return 4 + 4 + 2 * 2
    return 4 + 2


def persistent_tensors_per_layer(model: ModelSpec, threshold: int = 100_000) -> int:
    """Tensors of one layer small enough that DeepSpeed 0.3's ZeRO-3 keeps them gathered
    (``stage3_param_persistence_threshold``, 1e5 elements by default): biases and norm weights,
    all of length h or 3h/4h (QKV and FFN-in biases)."""
    if model.position_embedding == "learned":  # 4 biases + 2 LayerNorms (weight, bias)
        widths = [
            3 * model.hidden_size,
            model.hidden_size,
            model.ffn_hidden_size,
            model.hidden_size,
        ]
        widths += [model.hidden_size] * 4
    else:  # 2 RMSNorm weights
        widths = [model.hidden_size] * 2
    return sum(1 for w in widths if w < threshold)


def embedding_params(model: ModelSpec) -> int:
    return model.vocab_size * model.hidden_size


def active_params(model: ModelSpec) -> int:
    """Weights one token passes through: every layer's attention and norms, its top-k routed
    and the shared experts, the router, embeddings (as in ``num_params``); DeepSeek-V3's 37B."""
    routed_idle = (model.num_experts - model.moe_top_k) * mlp_params(
        model, model.expert_ffn_hidden_size
    )
    return num_params(model) - model.num_moe_layers * routed_idle


def num_params(model: ModelSpec) -> int:
    """All weights: layers, input embedding, output layer (unless tied), final norm."""
    dense = model.num_layers - model.num_moe_layers
    total = dense * params_per_layer(model) + model.num_moe_layers * params_per_layer(model, True)
    total += embedding_params(model) * (1 if model.tied_embeddings else 2)
    return total + model.hidden_size


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs of one layer for ``tokens`` tokens of sequences of length ``seq``."""

    qkv: float
    attn_core: float  # QK^T and AV, causal counted in full
    proj: float
    mlp: float

    @property
    def gemm(self) -> float:
        return self.qkv + self.proj + self.mlp

    @property
    def total(self) -> float:
        return self.gemm + self.attn_core


def layer_flops(model: ModelSpec, tokens: float, seq: float, moe: bool = False) -> LayerFlops:
    h, d = model.hidden_size, model.kv_channels
    q = model.num_attention_heads * d
    kv = model.kv_heads * d
    if moe:
        ffn = model.expert_ffn_hidden_size
        active = model.moe_top_k + model.num_shared_experts
        mlp = 2 * tokens * active * mlp_params(model, ffn) + 2 * tokens * h * model.num_experts
    else:
        mlp = 2 * tokens * mlp_params(model, model.ffn_hidden_size)
    if model.is_mla:
        dqk, dv = mla_head_dims(model)
        a = model.num_attention_heads
        gemms = mla_gemms(model)
        return LayerFlops(
            qkv=2 * tokens * sum(i * o for name, i, o, _ in gemms if name != "o"),
            attn_core=2 * tokens * seq * a * (dqk + dv),  # scores and AV, full square
            proj=2 * tokens * a * dv * h,
            mlp=mlp,
        )
    return LayerFlops(
        qkv=2 * tokens * h * (q + 2 * kv),
        attn_core=2 * 2 * tokens * seq * q,  # scores (s x s per head) and AV, full square
        proj=2 * tokens * q * h,
        mlp=mlp,
    )


def layer_gemms(model: ModelSpec, moe: bool = False) -> list[tuple[str, int, int, bool]]:
    """The layer's GEMMs in execution order as (name, in_features, out_features, row_parallel).

    Row-parallel GEMMs (attention output, FFN down) split their input over TP ranks; the others
    split their output. Llama's SwiGLU runs w1 (gate), w3 (up), w2 (down) (torchtitan's order).
    """
    h, d = model.hidden_size, model.kv_channels
    hq, hkv = model.num_attention_heads * d, model.kv_heads * d
    ffn = model.expert_ffn_hidden_size if moe else model.ffn_hidden_size
    out = [("wq", h, hq, False), ("wk", h, hkv, False), ("wv", h, hkv, False), ("wo", hq, h, True)]
    if model.ffn_activation == "swiglu":
        out += [("w1", h, ffn, False), ("w3", h, ffn, False), ("w2", ffn, h, True)]
    else:
        out += [("fc1", h, ffn, False), ("fc2", ffn, h, True)]
    return out


def op_sac_saved(index: int) -> bool:
    """torchtitan's op-level selective checkpointing saves every other matmul output, the 1st,
    3rd, ... of each layer (``mm_count % 2 == 0`` is recomputed), plus attention outputs."""
    return index % 2 == 0


def logits_flops(model: ModelSpec, tokens: float) -> float:
    return 2 * tokens * model.hidden_size * model.vocab_size


def counted_keys(model: ModelSpec, seq: float) -> float:
    """Keys a query's attention is counted against, averaged over the layers: the whole sequence
    in a full layer (causal counted in full), the window in a sliding-window one (the band
    counted in full the same way)."""
    windowed = model.windowed_layers
    if not windowed or model.attention_window is None:
        return seq
    return seq + windowed * (min(seq, model.attention_window) - seq) / model.num_layers


def model_flops_per_token(model: ModelSpec, seq: int | None = None) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), no recompute; a
    sliding-window layer's attention core counts its window's keys (``counted_keys``)."""
    seq = counted_keys(model, seq or model.seq_length)
    dense = model.num_layers - model.num_moe_layers
    fwd = dense * layer_flops(model, 1, seq).total
    if model.num_moe_layers:
        fwd += model.num_moe_layers * layer_flops(model, 1, seq, moe=True).total
    fwd += logits_flops(model, 1)
    if model.mtp_layers:  # each MTP module: a layer, its 2h -> h projection and the output head
        kind = model.is_moe
        per = layer_flops(model, 1, seq, moe=kind).total + 2 * 2 * model.hidden_size**2
        fwd += model.mtp_layers * (per + logits_flops(model, 1))
    return 3 * fwd
