"""DeepSpeed config JSON (+ the model, which DeepSpeed's config does not describe) ⇄ run spec.

Keys and defaults are DeepSpeed v0.19.8's (``deepspeed/runtime/config.py``, ``zero/config.py``,
``engine.py``, ``lr_schedules.py``; the "DeepSpeed Configuration JSON" docs): train_batch_size =
train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size, any two given
(gradient_accumulation_steps defaults to 1); zero_optimization.stage 0; overlap_comm false
(true at stage 3); gradient_clipping 0 (off); steps_per_print 10; fp16 / bf16 off (fp32
training); gradients reduced in the training dtype unless communication_data_type says
otherwise (``engine.communication_data_type``); WarmupCosineLR warms up for warmup_num_steps
1000, logarithmically (warmup_type log) from warmup_min_ratio 0, and decays to cos_min_ratio
0.0001. Plain DeepSpeed is data parallel only (tp = pp = cp = ep = 1). The model comes from
``--model``: a preset name or a Hugging Face ``config.json`` (LlamaConfig-style keys;
MixtralConfig / Qwen3MoeConfig / DeepseekV3Config keys for a mixture of experts, multi-latent
attention and multi-token prediction).
"""

from __future__ import annotations

import json
from typing import Any

from aihpc.interop._common import (
    Imported,
    as_int,
    cluster_table,
    model_table,
    not_carried,
)
from aihpc.spec import CheckpointSpec, RunSpec, SpecError, TrainingSpec
from aihpc.spec.model import model_presets

__all__ = ["FIXED", "export_deepspeed", "import_deepspeed"]

FRAMEWORK = "DeepSpeed"
FIXED: dict[str, Any] = {
    "pipeline_split": "uneven",
    "kv_repeat": False,
    "cp_exchange": "ring",
    "fp8_saved_inputs": "fp8",
    "fp8_param_gather": False,
    "pp_comm_ctas": 0,
    "cp_comm_ctas": 0,
}
# [training] fields the model code and training script decide under DeepSpeed, not its JSON:
# an import gives aihpc's defaults.
MODEL_CODE = ("attention", "cross_entropy", "fused_kernels", "dropout", "seed", "optimizer_dtype")
_HF_ACT = {
    "silu": "swiglu",
    "swiglu": "swiglu",
    "gelu": "gelu",
    "gelu_new": "gelu",
    "relu2": "relu2",
}


class _Json:
    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.read: set[str] = set()

    def get(self, path: str, default: Any = None) -> Any:
        self.read.add(path)
        node: Any = self.data
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def unread(self) -> list[str]:
        out = []

        def walk(node: dict[str, Any], prefix: str) -> None:
            for k, v in node.items():
                path = f"{prefix}{k}"
                if path in self.read:
                    continue
                if isinstance(v, dict) and any(r.startswith(path + ".") for r in self.read):
                    walk(v, path + ".")
                else:
                    out.append(path)

        walk(self.data, "")
        return out


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


def _check_hf_numbers(config: dict[str, Any]) -> None:
    """SpecError naming the first key whose value is not a number (a count: an integer)."""
    ints = (*_HF_INTS, *_HF_EXPERTS, *_HF_FREQ, *_HF_MLA)
    for key in (*ints, *_HF_FLOATS):
        value = config.get(key)
        if value is None:
            continue
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or (key in ints and value != int(value)):
            kind = "an integer" if key in ints else "a number"
            raise SpecError(f"--model {key}", value, f"expected {kind}")


def hf_model_shape(config: dict[str, Any], seq_length: int | None) -> dict[str, Any]:
    """A Hugging Face config.json (Llama-style keys) → run-spec model fields."""
    _check_hf_numbers(config)
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
        raise SpecError(f"--model {err.args[0]}", None, "required in config.json") from None
    act = config.get("hidden_act", "silu")
    if act not in _HF_ACT:
        raise SpecError("--model hidden_act", act, "allowed: " + " | ".join(_HF_ACT))
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
    shape.update(_hf_moe(config, shape["ffn_hidden_size"]))
    if config.get("kv_lora_rank") is not None:  # DeepseekV3Config's multi-latent attention
        for key, name in _HF_MLA.items():
            if config.get(key) is not None:
                shape[name] = int(config[key])
    mtp = config.get("num_nextn_predict_layers") or 0
    if mtp:
        shape["mtp_layers"] = int(mtp)
    shape.update(_hf_window(config, shape["num_layers"]))
    return shape


def _hf_window(config: dict[str, Any], layers: int) -> dict[str, int]:
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
    if types is not None:
        sliding = [t == "sliding_attention" for t in types]
        every = next((i + 1 for i, win in enumerate(sliding) if not win), 0)
        if sliding != _sliding_layers(layers, every):
            full = [i + 1 for i, win in enumerate(sliding) if not win]
            shown = f"{len(types)} layers, full at {full[:6]}{' ...' if len(full) > 6 else ''}"
            raise SpecError(
                "--model layer_types",
                shown,
                f"{layers} entries, every n-th layer full attention and the others sliding",
            )
        out["full_attention_every"] = every
    elif config.get("sliding_window_pattern"):
        out["full_attention_every"] = int(config["sliding_window_pattern"])
    elif config.get("model_type") == "gemma2":  # its modelling code alternates, banded first
        out["full_attention_every"] = 2
    return out


def _sliding_layers(layers: int, every: int) -> list[bool]:
    """Which layers are windowed when every ``every``-th one is full (0: none is)."""
    return [not (every and (i + 1) % every == 0) for i in range(layers)]


# Hugging Face config.json keys of a mixture of experts → run-spec fields. The expert count is
# num_local_experts (MixtralConfig), n_routed_experts (DeepseekV3Config) or num_experts
# (Qwen3MoeConfig); the rest are DeepseekV3Config's (transformers v4.57, configuration_deepseek_v3
# .py), with Llama 4's interleave_moe_layer_step / Qwen's decoder_sparse_step read as the MoE
# layer frequency and Qwen2-MoE's shared_expert_intermediate_size as shared experts.
_HF_EXPERTS = ("num_local_experts", "n_routed_experts", "num_experts")
_HF_FREQ = ("moe_layer_freq", "interleave_moe_layer_step", "decoder_sparse_step")
_HF_MLA = {
    "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
}


def _hf_moe(config: dict[str, Any], ffn: int) -> dict[str, Any]:
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
                "--model shared_expert_intermediate_size",
                shared,
                f"a multiple of the expert FFN size {moe_ffn} (aihpc counts whole shared experts)",
            )
        out["num_shared_experts"] = shared // moe_ffn
    if config.get("seq_aux", True) and config.get("aux_loss_alpha"):
        out["moe_aux_loss_coeff"] = float(config["aux_loss_alpha"])
    return out


def _model(model: str | None, model_text: str | None, seq_length: int | None) -> dict[str, Any]:
    if model_text is not None:
        try:
            config = json.loads(model_text)
        except ValueError as err:
            raise SpecError("--model", model, f"not valid JSON: {err}") from None
        return model_table(hf_model_shape(config, seq_length))
    if model is None:
        raise SpecError(
            "--model", None, "DeepSpeed's config has no model: a preset or a config.json"
        )
    if model not in model_presets():
        raise SpecError("--model", model, "a preset (aihpc presets) or a config.json path")
    return {"preset": model, **({"seq_length": seq_length} if seq_length else {})}


def _batch(j: _Json, num_gpus: int | None) -> tuple[int, int, int]:
    """(global batch, micro-batch, world size): DeepSpeed's batch identity, any two given."""
    gbs = j.get("train_batch_size")
    mbs = j.get("train_micro_batch_size_per_gpu")
    gas = j.get("gradient_accumulation_steps")
    if gbs is not None and mbs is not None and num_gpus is None:
        world = gbs // (mbs * (gas or 1))
    elif num_gpus is not None:
        world = num_gpus
    else:
        raise SpecError(
            "--num-gpus", None, "the config does not fix the world size: pass --num-gpus N"
        )
    if mbs is None:
        mbs = gbs // (world * (gas or 1))
    gas = gas or 1 if gbs is None else gbs // (mbs * world)
    if gbs is None:
        gbs = mbs * gas * world
    if mbs * gas * world != gbs or world < 1:
        raise SpecError(
            "train_batch_size",
            gbs,
            f"must equal micro-batch {mbs} x accumulation {gas} x world size {world}",
        )
    return int(gbs), int(mbs), int(world)


def _precision(j: _Json) -> str:
    if j.get("bf16.enabled", False):
        return "bf16"
    if j.get("fp16.enabled", False):
        return "fp16"
    raise SpecError(
        "bf16.enabled",
        False,
        "DeepSpeed trains in fp32 without bf16 / fp16; aihpc prices bf16, fp16",
    )


def import_deepspeed(
    text: str,
    model: str | None = None,
    model_text: str | None = None,
    seq_length: int | None = None,
    gpu: str = "h100-sxm",
    num_gpus: int | None = None,
    gpus_per_node: int | None = None,
) -> Imported:
    """A DeepSpeed config JSON and a model → run spec."""
    try:
        data = json.loads(text)
    except ValueError as err:
        raise SpecError("SOURCE", "DeepSpeed JSON", f"not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise SpecError("SOURCE", "DeepSpeed JSON", "expected a JSON object")
    j = _Json(data)
    notes: list[str] = []
    parallel, world = _parallel_table(j, num_gpus, notes)
    training = _training_table(j, notes)
    for key in (
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "fp16.enabled",
        "bf16.enabled",
        "zero_optimization.zero_hpz_partition_size",
    ):
        j.get(key)
    tables: dict[str, dict[str, Any]] = {
        "model": _model(model, model_text, seq_length),
        "cluster": cluster_table(gpu, world, gpus_per_node),
        "parallel": parallel,
        "training": training,
    }
    return Imported(FRAMEWORK, tables, j.unread(), notes)


def _parallel_table(j: _Json, num_gpus: int | None, notes: list[str]) -> tuple[dict, int]:
    """[parallel] from the batch sizes, the ZeRO stage (and ZeRO++ hpZ) and activation
    checkpointing; the world size beside it."""
    gbs, mbs, world = _batch(j, num_gpus)
    stage = as_int(j.get("zero_optimization.stage", 0), "zero_optimization.stage")
    hpz = j.get("zero_optimization.zero_hpz_partition_size", 1)
    parallel: dict[str, Any] = {
        "tp": 1,
        "pp": 1,
        "cp": 1,
        "dp": world,
        "zero_stage": stage,
        "micro_batch_size": mbs,
        "global_batch_size": gbs,
        "sequence_parallel": False,
        "recompute": "full" if isinstance(j.get("activation_checkpointing"), dict) else "none",
    }
    if parallel["recompute"] == "full":
        notes.append(
            "activation_checkpointing present: priced as deepspeed.checkpointing of every layer"
            " (full recompute); the model code decides what it wraps"
        )
        for key in (
            "partition_activations",
            "contiguous_memory_optimization",
            "number_checkpoints",
            "synchronize_checkpoint_boundary",
            "profile",
        ):
            j.get(f"activation_checkpointing.{key}")
    if stage == 3 and hpz and hpz > 1:
        notes.append(f"ZeRO++ hpZ {hpz}: parameters gathered within groups of {hpz} (dp_shard)")
        parallel["dp_shard"] = int(hpz)
    return parallel, world


def _training_table(j: _Json, notes: list[str]) -> dict[str, Any]:
    """[training] from the precision, communication dtype, optimizer and scheduler."""
    stage = as_int(j.get("zero_optimization.stage", 0), "zero_optimization.stage")
    precision = _precision(j)
    # engine.communication_data_type: the config's, else the training dtype
    comm = j.get("communication_data_type") or precision
    grad_dtype = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}.get(comm)
    if grad_dtype is None:
        raise SpecError("communication_data_type", comm, "allowed: fp32 | fp16 | bf16")
    opt = j.get("optimizer.type", "AdamW")
    opt_name = {"adamw": "adamw", "adam": "adam", "sgd": "sgd"}.get(str(opt).lower())
    if opt_name is None:
        raise SpecError("optimizer.type", opt, "aihpc prices AdamW | Adam | SGD")
    if opt_name == "adam" and j.get("optimizer.params.adam_w_mode", True):
        opt_name = "adamw"  # DeepSpeed's FusedAdam / Adam default to decoupled weight decay
    betas = j.get("optimizer.params.betas", [0.9, 0.999])
    lr = float(j.get("optimizer.params.lr", 1e-3))
    training: dict[str, Any] = {
        "precision": precision,
        "optimizer": opt_name,
        "grad_reduce_dtype": grad_dtype,
        "grad_reduce_overlap": bool(j.get("zero_optimization.overlap_comm", stage == 3)),
        "learning_rate": lr,
        "weight_decay": float(j.get("optimizer.params.weight_decay", 0.01)),
        "adam_beta1": float(betas[0]),
        "adam_beta2": float(betas[1]),
        "grad_clip": float(j.get("gradient_clipping", 0.0)),
        "log_interval": as_int(j.get("steps_per_print", 10), "steps_per_print"),
        **FIXED,
    }
    training.update(_scheduler(j, notes))
    for key in ("eps", "adam_w_mode"):
        j.get(f"optimizer.params.{key}")
    return training


def _scheduler(j: _Json, notes: list[str]) -> dict[str, Any]:
    kind = j.get("scheduler.type")
    if kind is None:
        return {"warmup_steps": 0, "min_lr_ratio": 1.0}  # constant learning rate
    if kind != "WarmupCosineLR":
        return {}  # other schedules are listed as not priced
    total = j.get("scheduler.params.total_num_steps")
    out = {
        "warmup_steps": as_int(
            j.get("scheduler.params.warmup_num_steps", 1000), "warmup_num_steps"
        ),
        "min_lr_ratio": float(j.get("scheduler.params.cos_min_ratio", 0.0001)),
    }
    if total is not None:
        out["train_steps"] = as_int(total, "scheduler.params.total_num_steps")
    # WarmupCosineLR's warmup is logarithmic unless warmup_type says linear, and starts from
    # warmup_min_ratio (0); aihpc's is linear from 0 (lr_schedules.py)
    warmup_type = j.get("scheduler.params.warmup_type")
    if warmup_type != "linear":
        said = "DeepSpeed's default" if warmup_type is None else "the source's"
        notes.append(
            f"scheduler warmup_type {warmup_type or 'log'} ({said}): the run spec warms up linearly"
        )
    start = j.get("scheduler.params.warmup_min_ratio", 0.0)
    if start:
        notes.append(f"scheduler warmup_min_ratio {start}: the run spec warms up from 0")
    return out


def _scheduler_json(t: TrainingSpec) -> dict[str, Any] | None:
    """WarmupCosineLR for the run spec's linear warmup and cosine decay; None (no scheduler) for
    a constant learning rate. DeepSpeed 0.19.8 refuses warmup_num_steps 0 and warms up for at
    least 2 steps (WarmupCosineLR.__init__), so 0 or 1 warmup steps with a decay has no form."""
    if t.warmup_steps == 0 and t.min_lr_ratio == 1.0:
        return None
    if t.warmup_steps < 2:
        raise SpecError(
            "training.warmup_steps",
            t.warmup_steps,
            "DeepSpeed's WarmupCosineLR warms up for at least 2 steps: >= 2"
            " (or 0 with min_lr_ratio = 1, a constant learning rate)",
        )
    params = {
        "total_num_steps": t.train_steps,
        "warmup_num_steps": t.warmup_steps,
        "warmup_type": "linear",
        "cos_min_ratio": t.min_lr_ratio,
    }
    return {"type": "WarmupCosineLR", "params": params}


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
    }
    if m.head_dim is not None:
        out["head_dim"] = m.head_dim
    if m.is_moe:
        out.update(_hf_moe_config(m))
    if m.is_mla:
        out.update({key: getattr(m, name) for key, name in _HF_MLA.items()})
    if m.mtp_layers:
        out["num_nextn_predict_layers"] = m.mtp_layers
    if m.attention_window is not None:
        every = m.full_attention_every
        out["sliding_window"] = m.attention_window
        out["layer_types"] = [
            "sliding_attention" if win else "full_attention"
            for win in _sliding_layers(m.num_layers, every)
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


def export_deepspeed(spec: RunSpec) -> tuple[str, str, list[str]]:
    """(the DeepSpeed config JSON, the model as a HF config.json, fields not carried); a plan
    plain DeepSpeed cannot run raises SpecError naming the field."""
    _refuse_inexpressible(spec)
    data = _config_json(spec)
    dropped = _export_not_carried(spec, "scheduler" in data)
    return json.dumps(data, indent=2) + "\n", json.dumps(hf_config(spec), indent=2) + "\n", dropped


def _refuse_inexpressible(spec: RunSpec) -> None:
    """SpecError naming the first field plain DeepSpeed (or a config.json) cannot express."""
    m, p, t = spec.model, spec.plan(), spec.training
    for name in ("tp", "pp", "cp", "ep"):
        if getattr(p, name) > 1:
            raise SpecError(
                f"parallel.{name}",
                getattr(p, name),
                "DeepSpeed's engine is data parallel (ZeRO) only: 1",
            )
    if p.recompute in ("selective", "op"):
        raise SpecError(
            "parallel.recompute", p.recompute, "DeepSpeed checkpoints layers: none | full"
        )
    if p.offload_layers:
        raise SpecError(
            "parallel.offload_layers",
            p.offload_layers,
            "DeepSpeed offloads states, not activations: 0",
        )
    if p.etp > 1:
        raise SpecError("parallel.etp", p.etp, "DeepSpeed's engine is data parallel only: 1")
    if p.moe_a2a_overlap != "none":
        raise SpecError(
            "parallel.moe_a2a_overlap", p.moe_a2a_overlap, "DeepSpeed (ep = 1) has none: none"
        )
    if p.recompute_modules:
        raise SpecError(
            "parallel.recompute_modules",
            list(p.recompute_modules),
            "DeepSpeed checkpoints whole layers: []",
        )
    # MoE fields a config.json has no key for (no Hugging Face MoE config names them)
    if m.moe_capacity_factor is not None:
        raise SpecError(
            "model.moe_capacity_factor", m.moe_capacity_factor, "a config.json says none: unset"
        )
    if m.moe_router_bias_update_rate:
        raise SpecError(
            "model.moe_router_bias_update_rate",
            m.moe_router_bias_update_rate,
            "a config.json says none: 0",
        )
    if m.position_embedding == "learned":
        raise SpecError(
            "model.position_embedding", "learned", "the config.json written is Llama-style: rope"
        )
    if t.precision == "fp8":
        raise SpecError("training.precision", "fp8", "DeepSpeed's config trains bf16 | fp16")
    if p.dp_shard is not None and p.dp_shard != p.dp and p.zero_stage != 3:
        raise SpecError("parallel.dp_shard", p.dp_shard, "DeepSpeed's hpZ groups need zero_stage 3")


def _config_json(spec: RunSpec) -> dict[str, Any]:
    """The DeepSpeed config of the plan: batch, precision, ZeRO, optimizer, scheduler."""
    p, t = spec.plan(), spec.training
    zero: dict[str, Any] = {"stage": p.zero_stage, "overlap_comm": t.grad_reduce_overlap}
    if p.zero_stage == 3 and p.dp_shard is not None and p.dp_shard != p.dp:
        zero["zero_hpz_partition_size"] = p.dp_shard
    data: dict[str, Any] = {
        "train_batch_size": p.global_batch_size,
        "train_micro_batch_size_per_gpu": p.micro_batch_size,
        "gradient_accumulation_steps": p.num_microbatches,
        "gradient_clipping": t.grad_clip,
        "steps_per_print": t.log_interval,
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {"enabled": t.precision == "fp16"},
        "communication_data_type": t.grad_reduce_dtype,
        "zero_optimization": zero,
        "optimizer": {
            "type": {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}[t.optimizer],
            "params": {
                "lr": t.learning_rate,
                "betas": [t.adam_beta1, t.adam_beta2],
                "weight_decay": t.weight_decay,
                **({"adam_w_mode": False} if t.optimizer == "adam" else {}),
            },
        },
    }
    if t.optimizer == "sgd":
        del data["optimizer"]["params"]["betas"]
    scheduler = _scheduler_json(t)
    if scheduler is not None:
        data["scheduler"] = scheduler
    if p.recompute == "full":
        data["activation_checkpointing"] = {"partition_activations": False}
    return data


def _export_not_carried(spec: RunSpec, has_scheduler: bool) -> list[str]:
    """Fields set away from their defaults that the DeepSpeed config does not carry."""
    t = spec.training
    dropped = not_carried(spec, FIXED, FRAMEWORK)
    defaults = TrainingSpec()
    dropped += [
        f"training.{k} = {getattr(t, k)!r} (DeepSpeed: the model code decides)"
        for k in MODEL_CODE
        if getattr(t, k) != getattr(defaults, k)
    ]
    if not has_scheduler and t.train_steps != defaults.train_steps:
        dropped.append("training.train_steps (DeepSpeed: no scheduler, the training script stops)")
    if spec.checkpoint.interval_steps != CheckpointSpec().interval_steps:
        dropped.append("checkpoint.interval_steps (DeepSpeed: the training script saves)")
    return dropped
