"""Run spec → a Hugging Face ``config.json`` of its model (LlamaConfig, or MixtralConfig /
Qwen3MoeConfig / DeepseekV3Config keys for MoE, MLA and MTP), as transformers' configuration
classes read it: what ``aihpc export --to hf`` and DeepSpeed's export (``--model-out``) write.
"""

from __future__ import annotations

import json
from typing import Any

from aihpc.interop._common import model_fields
from aihpc.interop.hf.reader import HF_MLA, hf_model_shape, sliding_layers
from aihpc.runspec import RunSpec
from aihpc.runspec.model import model_from_table

__all__ = ["export_hf", "hf_config"]


def hf_config(spec: RunSpec) -> dict[str, Any]:
    m = spec.model
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.kv_heads,
        "intermediate_size": m.ffn_hidden_size,
        "vocab_size": m.vocab_size,
        "max_position_embeddings": m.seq_length,
        "hidden_act": "silu" if m.ffn_activation == "swiglu" else m.ffn_activation,
        "tie_word_embeddings": m.tied_embeddings,
        "rope_theta": m.rope_theta,
    }
    if m.head_dim is not None:
        out["head_dim"] = m.head_dim
    if m.is_moe:
        out.update(_hf_moe_config(m))
    if m.is_mla:
        out.update({key: getattr(m, name) for key, name in HF_MLA.items()})
    if m.mtp_layers:
        out["num_nextn_predict_layers"] = m.mtp_layers
    if m.attention_window is not None:
        every = m.full_attention_every
        out["sliding_window"] = m.attention_window
        out["layer_types"] = [
            "sliding_attention" if win else "full_attention"
            for win in sliding_layers(m.num_layers, every)
        ]
    if m.is_mla or m.mtp_layers:
        out["architectures"], out["model_type"] = ["DeepseekV3ForCausalLM"], "deepseek_v3"
    return out


def _hf_moe_config(m: Any) -> dict[str, Any]:
    """The MoE keys of the config.json: MixtralConfig's when the experts are the FFN, else
    Qwen3MoeConfig's or (shared experts, dense layers first, grouped routing, sigmoid scores)
    DeepseekV3Config's key names."""
    deepseek = bool(
        m.num_shared_experts
        or m.first_dense_layers
        or m.moe_layer_freq != 1
        or m.moe_router_groups
        or m.moe_router_score_function != "softmax"
        or m.moe_router_topk_scaling_factor != 1.0
        or m.moe_aux_loss_coeff
    )
    out: dict[str, Any] = {"num_experts_per_tok": m.moe_top_k}
    if deepseek:
        out.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
        out.update(n_routed_experts=m.num_experts, moe_intermediate_size=m.expert_ffn_hidden_size)
        out.update(n_shared_experts=m.num_shared_experts)
        out.update(first_k_dense_replace=m.first_dense_layers, moe_layer_freq=m.moe_layer_freq)
        out.update(n_group=m.moe_router_groups, topk_group=m.moe_router_group_topk)
        out.update(scoring_func=m.moe_router_score_function)
        out.update(routed_scaling_factor=m.moe_router_topk_scaling_factor)
        if m.moe_aux_loss_coeff:
            out.update(aux_loss_alpha=m.moe_aux_loss_coeff, seq_aux=True)
    elif m.moe_ffn_hidden_size is not None and m.moe_ffn_hidden_size != m.ffn_hidden_size:
        out.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe")
        out.update(num_experts=m.num_experts, moe_intermediate_size=m.moe_ffn_hidden_size)
    else:
        out.update(architectures=["MixtralForCausalLM"], model_type="mixtral")
        out["num_local_experts"] = m.num_experts
    return out


def export_hf(spec: RunSpec) -> tuple[str, list[str]]:
    """(the config.json text, the model fields it cannot carry): read back with
    ``hf_model_shape``, every field that does not come back is named (a router's bias update
    rate is a training setting, not a config key)."""
    config = hf_config(spec)
    back = model_fields(model_from_table(hf_model_shape(config, spec.model.seq_length)))
    mine = model_fields(spec.model)
    dropped = [
        f"model.{k} = {v!r} (a config.json has no key for it)"
        for k, v in mine.items()
        if back.get(k) != v
    ]
    return json.dumps(config, indent=2) + "\n", dropped
