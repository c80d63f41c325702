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
0.0001; WarmupLR / WarmupDecayLR warm up from warmup_min_lr 0 to warmup_max_lr 0.001 (the
learning rate they set) and hold it / decay it linearly to 0 at total_num_steps. Plain
DeepSpeed is data parallel only (tp = pp = cp = ep = 1). The model comes from ``--model``: a
preset name or a Hugging Face ``config.json`` (interop/hf).
"""

from __future__ import annotations

import math
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
from aihpc.runspec.inputs import parse_json
from aihpc.runspec.model import model_presets

__all__ = ["import_deepspeed"]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


# What a key's value must be, checked as it is read: a string or a table where DeepSpeed reads
# a number was a traceback deep in the arithmetic (issue 42).
_KINDS: dict[str, tuple[Any, str]] = {
    "int": (_is_int, "expected an integer"),
    "count": (lambda v: _is_int(v) and v >= 1, "expected an integer >= 1"),
    "num": (_is_num, "expected a finite number"),
    "bool": (lambda v: isinstance(v, bool), "expected true or false"),
    "str": (lambda v: isinstance(v, str), "expected a string"),
}
# Keys the Hugging Face Trainer's DeepSpeed integration fills in when they say "auto"
# (transformers/integrations/deepspeed.py, HfTrainerDeepSpeedConfig.trainer_config_process).
_AUTO = "auto"
# "auto" keys the Trainer fills from a TrainingArguments field: (that field, its default). A
# launch that passes other arguments fills other values: each one read is named in a note.
# train_batch_size = world x micro-batch x accumulation, as DeepSpeed's identity computes it;
# scheduler total_num_steps (from max_steps or the data) and the bucket sizes (from the
# model's hidden size) are left unset.
HF_AUTO: dict[str, tuple[str, Any]] = {
    "train_micro_batch_size_per_gpu": ("per_device_train_batch_size", 8),
    "gradient_accumulation_steps": ("gradient_accumulation_steps", 1),
    "gradient_clipping": ("max_grad_norm", 1.0),
    "optimizer.params.lr": ("learning_rate", 5e-5),
    "optimizer.params.betas": ("[adam_beta1, adam_beta2]", [0.9, 0.999]),
    "optimizer.params.eps": ("adam_epsilon", 1e-8),
    "optimizer.params.weight_decay": ("weight_decay", 0.0),
    "scheduler.params.warmup_num_steps": ("warmup_steps (warmup_ratio 0)", 0),
    "scheduler.params.warmup_min_lr": ("0", 0.0),
    "scheduler.params.warmup_max_lr": ("learning_rate", 5e-5),
}

# "auto" keys the Trainer fills from what the launch runs, not from a default: read as unset.
_AUTO_UNSET = {
    "scheduler.params.total_num_steps": " from max_steps (else the data's batches x epochs)",
}


class _Json:
    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.read: set[str] = set()
        self.auto: list[str] = []
        self.filled: list[str] = []
        self.filled_keys: set[str] = set()  # "auto" keys read as the Trainer's default

    def get(self, path: str, default: Any = None, kind: str | None = None) -> Any:
        """The value at the dotted ``path``; null is unset. With ``kind``, any other value is
        one line naming the key, and "auto" (the HF Trainer's) is unset too, noted."""
        self.read.add(path)
        node: Any = self.data
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        if node is None:
            return default
        if node == _AUTO:
            if path in HF_AUTO:
                field, value = HF_AUTO[path]
                self.filled.append(
                    f'{path} = "auto": the Hugging Face Trainer fills it from TrainingArguments '
                    f"{field}; read as its default {value}"
                )
                self.filled_keys.add(path)
                return value
            self.auto.append(path)
            return default
        if kind is None:
            return node
        check, allowed = _KINDS[kind]
        if not check(node):
            raise SpecError(path, node, allowed)
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
        config = parse_json(model_text, "--model", model)
        if not isinstance(config, dict):
            raise SpecError("--model", model, "expected a JSON object (a config.json)")
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
    gbs = j.get("train_batch_size", kind="count")
    mbs = j.get("train_micro_batch_size_per_gpu", kind="count")
    gas = j.get("gradient_accumulation_steps", kind="count")
    if num_gpus is not None and num_gpus < 1:
        raise SpecError("--num-gpus", num_gpus, "a positive integer")
    given = "gradient_accumulation_steps" not in j.filled_keys
    if gbs is not None and mbs is not None and gas is not None and given:
        # DeepSpeed's _batch_assertion: all three given must satisfy the identity
        if num_gpus is not None and gbs != mbs * gas * num_gpus:
            raise SpecError(
                "train_batch_size",
                gbs,
                "DeepSpeed refuses it: train_batch_size must equal train_micro_batch_size_per_gpu"
                f" x gradient_accumulation_steps x world size, {mbs} x {gas} x {num_gpus} = "
                f"{mbs * gas * num_gpus}",
            )
        if num_gpus is None and gbs % (mbs * gas):
            raise SpecError(
                "train_batch_size",
                gbs,
                "DeepSpeed refuses it: train_batch_size must equal train_micro_batch_size_per_gpu"
                f" x gradient_accumulation_steps x world size, and {gbs} is not a multiple of "
                f"{mbs} x {gas}",
            )
    if gbs is not None and mbs is not None and num_gpus is None:
        world = gbs // (mbs * (gas or 1))
    elif num_gpus is not None:
        world = num_gpus
    else:
        raise SpecError(
            "--num-gpus", None, "the config does not fix the world size: pass --num-gpus N"
        )
    if mbs is None and gbs is None:
        raise SpecError(
            "train_batch_size",
            None,
            "give train_batch_size or train_micro_batch_size_per_gpu (a number, not auto)",
        )
    if world < 1:
        raise SpecError(
            "train_batch_size", gbs, f"smaller than micro-batch {mbs} x accumulation {gas or 1}"
        )
    if mbs is None:
        mbs = gbs // (world * (gas or 1))
    if mbs < 1:
        raise SpecError(
            "train_batch_size", gbs, f"smaller than world size {world} x accumulation {gas or 1}"
        )
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
    if j.get("bf16.enabled", False, "bool"):
        return "bf16"
    if j.get("fp16.enabled", False, "bool"):
        return "fp16"
    auto = [k for k in ("bf16.enabled", "fp16.enabled") if k in j.auto]
    if auto:
        raise SpecError(
            auto[0], _AUTO, "the HF Trainer sets it from --bf16 / --fp16; write true for the run"
        )
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
    data = parse_json(text, "SOURCE", "DeepSpeed JSON")
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
    notes += list(dict.fromkeys(j.filled))
    notes += [
        f'{key} = "auto": the Hugging Face Trainer fills it in at launch'
        f"{_AUTO_UNSET.get(key, '')}; read as unset"
        for key in dict.fromkeys(j.auto)
    ]
    return Imported(FRAMEWORK, tables, j.unread(), notes)


def _parallel_table(j: _Json, num_gpus: int | None, notes: list[str]) -> tuple[dict, int]:
    """[parallel] from the batch sizes, the ZeRO stage (and ZeRO++ hpZ) and activation
    checkpointing; the world size beside it."""
    gbs, mbs, world = _batch(j, num_gpus)
    stage = as_int(j.get("zero_optimization.stage", 0), "zero_optimization.stage")
    hpz = j.get("zero_optimization.zero_hpz_partition_size", 1, "int")
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
    comm = j.get("communication_data_type", kind="str") or precision
    grad_dtype = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}.get(comm)
    if grad_dtype is None:
        raise SpecError("communication_data_type", comm, "allowed: fp32 | fp16 | bf16")
    opt = j.get("optimizer.type", "AdamW", "str")
    opt_name = {"adamw": "adamw", "adam": "adam", "sgd": "sgd"}.get(str(opt).lower())
    if opt_name is None:
        raise SpecError("optimizer.type", opt, "aihpc prices AdamW | Adam | SGD")
    if opt_name == "adam" and j.get("optimizer.params.adam_w_mode", True, "bool"):
        opt_name = "adamw"  # DeepSpeed's FusedAdam / Adam default to decoupled weight decay
    betas = j.get("optimizer.params.betas", [0.9, 0.999])
    if not (isinstance(betas, list) and len(betas) == 2 and all(map(_is_num, betas))):
        raise SpecError("optimizer.params.betas", betas, "expected two numbers [beta1, beta2]")
    lr = float(j.get("optimizer.params.lr", 1e-3, "num"))
    training: dict[str, Any] = {
        "precision": precision,
        "optimizer": opt_name,
        "grad_reduce_dtype": grad_dtype,
        "grad_reduce_overlap": j.get("zero_optimization.overlap_comm", stage == 3, "bool"),
        "learning_rate": lr,
        "weight_decay": float(j.get("optimizer.params.weight_decay", 0.01, "num")),
        "adam_beta1": float(betas[0]),
        "adam_beta2": float(betas[1]),
        "grad_clip": float(j.get("gradient_clipping", 0.0, "num")),
        "log_interval": as_int(j.get("steps_per_print", 10), "steps_per_print"),
        **FIXED,
    }
    training.update(_scheduler(j, lr, notes))
    for key in ("eps", "adam_w_mode"):
        j.get(f"optimizer.params.{key}")
    return training


# DeepSpeed's warm-up schedules (lr_schedules.py): WarmupLR holds warmup_max_lr after the
# warm-up, WarmupDecayLR decays it linearly to 0 at total_num_steps, WarmupCosineLR decays it by
# cosine to cos_min_ratio x the optimizer's lr; the others are listed as not priced.
_WARMUP_LR = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


def _scheduler(j: _Json, lr: float, notes: list[str]) -> dict[str, Any]:
    kind = j.get("scheduler.type", kind="str")
    if kind is None:
        return {"warmup_steps": 0, "min_lr_ratio": 1.0}  # constant learning rate
    if kind not in _WARMUP_LR:
        return {}  # other schedules are listed as not priced
    p = "scheduler.params."
    out: dict[str, Any] = {
        "warmup_steps": as_int(j.get(p + "warmup_num_steps", 1000), p + "warmup_num_steps"),
    }
    if kind == "WarmupCosineLR":
        out["min_lr_ratio"] = float(j.get(p + "cos_min_ratio", 0.0001, "num"))
        start = j.get(p + "warmup_min_ratio", 0.0, "num")
        if start:
            notes.append(f"scheduler warmup_min_ratio {start}: the run spec warms up from 0")
    else:
        # WarmupLR / WarmupDecayLR set the learning rate itself: warmup_min_lr -> warmup_max_lr
        peak = float(j.get(p + "warmup_max_lr", 0.001, "num"))
        if p + "warmup_max_lr" in j.filled_keys:
            peak = lr  # the Trainer fills both from its learning_rate
        if peak != lr:
            notes.append(
                f"{p}warmup_max_lr {peak}: DeepSpeed's {kind} sets the learning rate to it "
                f"(optimizer.params.lr {lr} is not used)"
            )
            out["learning_rate"] = peak
        start = j.get(p + "warmup_min_lr", 0.0, "num")
        if start:
            notes.append(f"scheduler warmup_min_lr {start}: the run spec warms up from 0")
        if kind == "WarmupLR":
            out["min_lr_ratio"] = 1.0  # held at warmup_max_lr after the warm-up
        else:
            out["min_lr_ratio"] = 0.0
            notes.append(
                "scheduler WarmupDecayLR decays linearly to 0 at total_num_steps: the run spec "
                "decays by cosine to 0"
            )
    if kind != "WarmupLR":
        total = j.get(p + "total_num_steps")
        if total is not None:
            out["train_steps"] = as_int(total, p + "total_num_steps")
    # the warm-up is logarithmic unless warmup_type says linear; aihpc's is linear from 0
    warmup_type = j.get(p + "warmup_type")
    if warmup_type != "linear":
        said = "DeepSpeed's default" if warmup_type is None else "the source's"
        notes.append(
            f"scheduler warmup_type {warmup_type or 'log'} ({said}): the run spec warms up linearly"
        )
    return out
