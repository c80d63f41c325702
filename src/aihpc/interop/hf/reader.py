"""Hugging Face ``config.json`` → the run spec's model: LlamaConfig-style keys, and MixtralConfig /
Qwen3MoeConfig / DeepseekV3Config keys for a mixture of experts, multi-latent attention,
multi-token prediction and sliding-window layers, as transformers' configuration classes name
them. ``aihpc import hf`` reads one as a run spec; DeepSpeed's import reads one as its model.
"""

from __future__ import annotations

import math
from pathlib import PurePath
from typing import Any

from aihpc.interop._common import Imported, cluster_table, model_table
from aihpc.interop.hf.vision import hf_vision, is_vlm_config
from aihpc.runspec import SpecError
from aihpc.runspec.cluster import gpu_from_id
from aihpc.runspec.inputs import parse_json

__all__ = ["HF_MLA", "hf_model_name", "hf_model_shape", "import_hf", "sliding_layers"]


_HF_ACT = {
    "silu": "swiglu",
    "swiglu": "swiglu",
    "gelu": "gelu",
    "gelu_new": "gelu",
    "relu2": "relu2",
}


# The config.json keys read as counts, and those read as numbers: checked once, before any is
# used, so a bad value is one line naming its key (int("abc") deep in the reading was a
# traceback).
_HF_INTS = (
    "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "n_positions",
    "num_nextn_predict_layers", "sliding_window", "sliding_window_pattern",
    "moe_intermediate_size", "num_experts_per_tok", "first_k_dense_replace", "n_shared_experts",
    "n_group", "topk_group", "shared_expert_intermediate_size",
)  # fmt: skip


_HF_FLOATS = ("routed_scaling_factor", "aux_loss_alpha")
_HF_REQUIRED = (
    "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size",
)  # fmt: skip


def _check_hf_numbers(config: dict[str, Any], where: str) -> None:
    """SpecError naming the first key whose value is not a number (a count: an integer)."""
    ints = (*_HF_INTS, *_HF_EXPERTS, *_HF_FREQ, *HF_MLA)
    for key in (*ints, *_HF_FLOATS):
        value = config.get(key)
        if value is None:
            continue
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or (key in ints and value != int(value)):
            kind = "an integer" if key in ints else "a finite number"
            raise SpecError(f"{where} {key}", value, f"expected {kind}")


def hf_model_shape(
    config: dict[str, Any], seq_length: int | None, where: str = "--model"
) -> dict[str, Any]:
    """A Hugging Face config.json (Llama-style keys) → run-spec model fields; ``where`` names the
    config in an error (``--model`` for DeepSpeed's import, ``CONFIG`` for ``aihpc import hf``)."""
    _check_hf_numbers(config, where)
    for key in _HF_REQUIRED:
        if config.get(key) is None:  # absent or null
            raise SpecError(f"{where} {key}", None, "required in config.json")
    try:
        h = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        shape: dict[str, Any] = {
            "num_layers": int(config["num_hidden_layers"]),
            "hidden_size": h,
            "num_attention_heads": heads,
            "ffn_hidden_size": int(config["intermediate_size"]),
            "vocab_size": int(config["vocab_size"]),
        }
    except KeyError as err:
        raise SpecError(f"{where} {err.args[0]}", None, "required in config.json") from None
    act = config.get("hidden_act", "silu")
    if not isinstance(act, str) or act not in _HF_ACT:
        raise SpecError(f"{where} hidden_act", act, "allowed: " + " | ".join(_HF_ACT))
    shape["ffn_activation"] = _HF_ACT[act]
    shape["tied_embeddings"] = bool(config.get("tie_word_embeddings", False))
    shape["position_embedding"] = "learned" if "n_positions" in config else "rope"
    kv = config.get("num_key_value_heads")
    if kv is not None and kv != heads:
        shape["num_kv_heads"] = int(kv)
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim * heads != h:
        shape["head_dim"] = int(head_dim)
    seq = seq_length or config.get("max_position_embeddings") or config.get("n_positions")
    if seq is None:
        raise SpecError("--seq-length", None, "the model gives no length: pass --seq-length N")
    shape["seq_length"] = int(seq)
    theta = config.get("rope_theta")  # LlamaConfig's default: 10000
    if theta is not None and shape["position_embedding"] == "rope":
        if isinstance(theta, bool) or not isinstance(theta, int | float):
            raise SpecError(f"{where} rope_theta", theta, "expected a number")
        shape["rope_theta"] = float(theta)
    shape.update(_hf_moe(config, shape["ffn_hidden_size"], where))
    if config.get("kv_lora_rank") is not None:  # DeepseekV3Config's multi-latent attention
        for key, name in HF_MLA.items():
            if config.get(key) is not None:
                shape[name] = int(config[key])
    mtp = config.get("num_nextn_predict_layers") or 0
    if mtp:
        shape["mtp_layers"] = int(mtp)
    shape.update(_hf_window(config, shape["num_layers"], where))
    return shape


def _hf_window(config: dict[str, Any], layers: int, where: str) -> dict[str, int]:
    """Sliding-window attention from a config.json: ``sliding_window`` keys per query (its own
    included, as transformers' masks count it), on the layers ``layer_types`` marks
    "sliding_attention" (GPT-OSS, Gemma 3), one full layer every ``sliding_window_pattern``
    (Gemma 3's older key), every other layer for a Gemma 2 config without ``layer_types``, or
    every layer (Mistral 7B v0.1); ``use_sliding_window`` false (Qwen2/3) turns it off. A
    layer pattern other than every n-th layer full is refused."""
    window = config.get("sliding_window")
    if window is None or config.get("use_sliding_window") is False:
        return {}
    out = {"attention_window": int(window)}
    types = config.get("layer_types")
    if types is not None and not (
        isinstance(types, list) and all(isinstance(t, str) for t in types)
    ):
        raise SpecError(f"{where} layer_types", types, "a list of strings, one per layer")
    if types is not None:
        sliding = [t == "sliding_attention" for t in types]
        every = next((i + 1 for i, win in enumerate(sliding) if not win), 0)
        if sliding != sliding_layers(layers, every):
            full = [i + 1 for i, win in enumerate(sliding) if not win]
            shown = f"{len(types)} layers, full at {full[:6]}{' ...' if len(full) > 6 else ''}"
            raise SpecError(
                f"{where} layer_types",
                shown,
                f"{layers} entries, every n-th layer full attention and the others sliding",
            )
        out["full_attention_every"] = every
    elif config.get("sliding_window_pattern"):
        out["full_attention_every"] = int(config["sliding_window_pattern"])
    elif config.get("model_type") == "gemma2":  # its modelling code alternates, banded first
        out["full_attention_every"] = 2
    return out


def sliding_layers(layers: int, every: int) -> list[bool]:
    """Which layers are windowed when every ``every``-th one is full (0: none is)."""
    return [not (every and (i + 1) % every == 0) for i in range(layers)]


# Hugging Face config.json keys of a mixture of experts → run-spec fields. The expert count is
# num_local_experts (MixtralConfig), n_routed_experts (DeepseekV3Config) or num_experts
# (Qwen3MoeConfig); the rest are DeepseekV3Config's (transformers v4.57, configuration_deepseek_v3
# .py), with Llama 4's interleave_moe_layer_step / Qwen's decoder_sparse_step read as the MoE
# layer frequency and Qwen2-MoE's shared_expert_intermediate_size as shared experts.
_HF_EXPERTS = ("num_local_experts", "n_routed_experts", "num_experts")


_HF_FREQ = ("moe_layer_freq", "interleave_moe_layer_step", "decoder_sparse_step")


HF_MLA = {
    "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
}


def _hf_moe(config: dict[str, Any], ffn: int, where: str) -> dict[str, Any]:
    experts = next((config[k] for k in _HF_EXPERTS if config.get(k)), 0)
    if not experts:
        return {}
    moe_ffn = int(config.get("moe_intermediate_size") or ffn)
    out: dict[str, Any] = {
        "num_experts": int(experts),
        "moe_top_k": int(config.get("num_experts_per_tok", 2)),
        "first_dense_layers": int(config.get("first_k_dense_replace") or 0),
        "moe_layer_freq": int(next((config[k] for k in _HF_FREQ if config.get(k)), 1)),
        "num_shared_experts": int(config.get("n_shared_experts") or 0),
        "moe_router_groups": int(config.get("n_group") or 0),
        "moe_router_group_topk": int(config.get("topk_group") or 0),
        "moe_router_score_function": str(config.get("scoring_func", "softmax")),
        "moe_router_topk_scaling_factor": float(config.get("routed_scaling_factor") or 1.0),
    }
    if moe_ffn != ffn:
        out["moe_ffn_hidden_size"] = moe_ffn
    shared = int(config.get("shared_expert_intermediate_size") or 0)
    if shared:
        if shared % moe_ffn:
            raise SpecError(
                f"{where} shared_expert_intermediate_size",
                shared,
                f"a multiple of the expert FFN size {moe_ffn} (aihpc counts whole shared experts)",
            )
        out["num_shared_experts"] = shared // moe_ffn
    if config.get("seq_aux", True) and config.get("aux_loss_alpha"):
        out["moe_aux_loss_coeff"] = float(config["aux_loss_alpha"])
    return out


FRAMEWORK = "Hugging Face"
TOKENS_PER_STEP = 4 * 2**20  # the default batch: about 4M tokens a step (Llama 3 70B's 4M start)


def hf_model_name(config: dict[str, Any], path: str) -> str:
    """The model's name: the repository ``_name_or_path`` gives (transformers writes it), else
    the folder holding config.json (a hub download's layout), else the architecture."""
    named = config.get("_name_or_path")
    if isinstance(named, str) and named.strip("/"):
        return named.rstrip("/").rsplit("/", 1)[-1]
    folder = PurePath(path).parent.name
    if folder and folder not in (".", ""):
        return folder
    arch = config.get("architectures")
    if isinstance(arch, list) and arch and isinstance(arch[0], str):
        return arch[0].removesuffix("ForCausalLM")
    return str(config.get("model_type") or "custom")


def import_hf(
    text: str,
    path: str,
    gpu: str = "h100-sxm",
    num_gpus: int | None = None,
    gpus_per_node: int | None = None,
    seq_length: int | None = None,
    global_batch_size: int | None = None,
) -> Imported:
    """A Hugging Face config.json → run spec: the model named from the config, the cluster
    given (one node of ``gpu`` by default), a global batch (about 4M tokens a step by default)
    and no other plan field, so that ``aihpc search`` chooses them."""
    config = parse_json(text, "CONFIG", path)
    if not isinstance(config, dict):
        raise SpecError("CONFIG", path, "expected a JSON object (a config.json)")
    notes: list[str] = []
    vision = None
    if is_vlm_config(config):  # a vision-language model: its language model and [model.vision]
        config, vision, note = hf_vision(config, "CONFIG")
        notes += [f"model.vision.{note}"] if note else []
    shape = hf_model_shape(config, seq_length, "CONFIG")
    if seq_length is None:
        notes.append(
            f"model.seq_length = {shape['seq_length']}: the longest the model takes "
            "(max_position_embeddings); --seq-length sets the training length"
        )
    model = model_table(shape)
    if "preset" not in model:
        model = {"name": hf_model_name(config, path), **model, "source": f"config.json {path}"}
    if vision is not None:
        model["vision"] = vision
    if num_gpus is None:
        num_gpus = gpus_per_node or gpu_from_id(gpu).gpus_per_node
        notes.append(f"cluster.num_gpus = {num_gpus}: one node; --num-gpus sets it")
    if global_batch_size is None:
        global_batch_size = max(1, round(TOKENS_PER_STEP / shape["seq_length"]))
        notes.append(
            f"parallel.global_batch_size = {global_batch_size}: about 4M tokens a step; "
            "--global-batch-size sets it"
        )
    tables = {
        "model": model,
        "cluster": cluster_table(gpu, num_gpus, gpus_per_node),
        "parallel": {"global_batch_size": global_batch_size},
    }
    return Imported(FRAMEWORK, tables, [], notes)
