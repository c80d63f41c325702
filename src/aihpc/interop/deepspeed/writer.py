"""Run spec → DeepSpeed: the config JSON plain DeepSpeed (data parallel, ZeRO 0-3) runs for the
plan, its batch, precision, optimizer and schedule, with the model as a Hugging Face config.json
beside it; a plan DeepSpeed cannot express is refused, naming the field.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from aihpc.interop._common import (
    not_carried,
)
from aihpc.interop.deepspeed.defaults import FIXED, FRAMEWORK, MODEL_CODE
from aihpc.interop.hf.writer import hf_config
from aihpc.runspec import (
    CheckpointSpec,
    ModelSpec,
    ParallelPlan,
    RunSpec,
    SpecError,
    TrainingSpec,
)

__all__ = [
    "deepspeed_as_run",
    "deepspeed_refusal",
    "deepspeed_training_refusal",
    "export_deepspeed",
]


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


def deepspeed_as_run(spec: RunSpec) -> tuple[RunSpec, list[str]]:
    """(the run spec as DeepSpeed runs the exported JSON: the [training] facts its runtime fixes,
    FIXED, in place of the run spec's; the fields that changed, "field = ours -> theirs")."""
    t = spec.training
    fixed = {k: v for k, v in FIXED.items() if getattr(t, k) != v}
    if t.precision != "fp8":
        fixed.pop("fp8_saved_inputs", None)  # read only by FP8 runs (and DeepSpeed runs none)
    if not fixed:
        return spec, []
    changes = [f"training.{k} = {getattr(t, k)!r} -> {v!r}" for k, v in fixed.items()]
    return replace(spec, training=replace(t, **fixed)), changes


def deepspeed_training_refusal(t: TrainingSpec) -> SpecError | None:
    """SpecError where DeepSpeed runs no plan of this training (its schedule); None if it runs
    it."""
    try:
        _scheduler_json(t)
    except SpecError as err:
        return err
    return None


def export_deepspeed(spec: RunSpec) -> tuple[str, str, list[str]]:
    """(the DeepSpeed config JSON, the model as a HF config.json, fields not carried); a plan
    plain DeepSpeed cannot run raises SpecError naming the field."""
    err = deepspeed_refusal(spec.model, spec.plan(), spec.training)
    if err is not None:
        raise err
    data = _config_json(spec)
    dropped = _export_not_carried(spec, "scheduler" in data)
    return json.dumps(data, indent=2) + "\n", json.dumps(hf_config(spec), indent=2) + "\n", dropped


def deepspeed_refusal(m: ModelSpec, p: ParallelPlan, t: TrainingSpec) -> SpecError | None:
    """The first field plain DeepSpeed (or a config.json) cannot express, as a SpecError; None
    if it runs the plan. Shared by the export and `aihpc search --for deepspeed`; depends on
    neither batch size."""
    for name in ("tp", "pp", "cp", "ep"):
        if getattr(p, name) > 1:
            return SpecError(
                f"parallel.{name}",
                getattr(p, name),
                "DeepSpeed's engine is data parallel (ZeRO) only: 1",
            )
    if p.recompute in ("selective", "op"):
        return SpecError(
            "parallel.recompute", p.recompute, "DeepSpeed checkpoints layers: none | full"
        )
    if p.offload_layers:
        return SpecError(
            "parallel.offload_layers",
            p.offload_layers,
            "DeepSpeed offloads states, not activations: 0",
        )
    if p.etp > 1:
        return SpecError("parallel.etp", p.etp, "DeepSpeed's engine is data parallel only: 1")
    if p.moe_a2a_overlap != "none":
        return SpecError(
            "parallel.moe_a2a_overlap", p.moe_a2a_overlap, "DeepSpeed (ep = 1) has none: none"
        )
    if p.recompute_modules:
        return SpecError(
            "parallel.recompute_modules",
            list(p.recompute_modules),
            "DeepSpeed checkpoints whole layers: []",
        )
    # MoE fields a config.json has no key for (no Hugging Face MoE config names them)
    if m.moe_capacity_factor is not None:
        return SpecError(
            "model.moe_capacity_factor", m.moe_capacity_factor, "a config.json says none: unset"
        )
    if m.moe_router_bias_update_rate:
        return SpecError(
            "model.moe_router_bias_update_rate",
            m.moe_router_bias_update_rate,
            "a config.json says none: 0",
        )
    if m.position_embedding == "learned":
        return SpecError(
            "model.position_embedding", "learned", "the config.json written is Llama-style: rope"
        )
    if t.precision == "fp8":
        return SpecError("training.precision", "fp8", "DeepSpeed's config trains bf16 | fp16")
    if p.dp_shard is not None and p.dp_shard != p.dp and p.zero_stage != 3:
        return SpecError(
            "parallel.dp_shard", p.dp_shard, "DeepSpeed's hpZ groups need zero_stage 3"
        )
    return None


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
