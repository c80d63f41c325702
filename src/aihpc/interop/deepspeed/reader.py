"""DeepSpeed → run spec: a DeepSpeed config JSON (+ the model, which DeepSpeed's config does not
describe) read with DeepSpeed's own defaults.

Keys and defaults are DeepSpeed v0.19.8's (``deepspeed/runtime/config.py``, ``zero/config.py``,
``engine.py``, ``lr_schedules.py``; the "DeepSpeed Configuration JSON" docs): train_batch_size =
train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size, any two given
(gradient_accumulation_steps defaults to 1); zero_optimization.stage 0; overlap_comm false
(true at stage 3); gradient_clipping 0 (off); steps_per_print 10; fp16 / bf16 off (fp32
training); gradients reduced in the training dtype unless communication_data_type says
otherwise (``engine.communication_data_type``); WarmupCosineLR warms up for warmup_num_steps
1000, logarithmically (warmup_type log) from warmup_min_ratio 0, and decays to cos_min_ratio
0.0001. Plain DeepSpeed is data parallel only (tp = pp = cp = ep = 1). The model comes from
``--model``: a preset name or a Hugging Face ``config.json`` (interop/hf).
"""

from __future__ import annotations

import json
from typing import Any

from aihpc.interop._common import (
    Imported,
    as_int,
    cluster_table,
    model_table,
)
from aihpc.interop.deepspeed.defaults import FIXED, FRAMEWORK
from aihpc.interop.hf.reader import hf_model_shape
from aihpc.runspec import SpecError
from aihpc.runspec.model import model_presets

__all__ = ["import_deepspeed"]


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
