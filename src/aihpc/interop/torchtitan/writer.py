"""Run spec → torchtitan: a v0.2.0 job TOML (``--job.config_file``) for the plan, with the llama3
flavor of the model; a plan torchtitan cannot run is refused, naming the field.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from aihpc.interop._common import (
    model_fields,
    not_carried,
)
from aihpc.interop.torchtitan.flavors import (
    FIXED,
    FLAVORS,
    FRAMEWORK,
    SCHEDULES,
    VERSION,
    flavor_shape,
)
from aihpc.runspec import ParallelPlan, RunSpec, SpecError, TrainingSpec
from aihpc.runspec._table import from_table
from aihpc.runspec.model import ModelSpec
from aihpc.runspec.tomlw import dumps_toml

__all__ = [
    "export_torchtitan",
    "torchtitan_as_run",
    "torchtitan_model_refusal",
    "torchtitan_refusal",
]


def torchtitan_model_refusal(spec: RunSpec) -> SpecError | None:
    """SpecError where the model is none of torchtitan's llama3 flavors; None if it is one."""
    try:
        _flavor(spec)
    except SpecError as err:
        return err
    return None


def torchtitan_as_run(spec: RunSpec) -> tuple[RunSpec, list[str]]:
    """(the run spec as torchtitan runs the exported TOML, the fields it changed, each
    "field = ours -> theirs"); the spec itself where nothing changed."""
    changes = _changes(spec)
    if not changes:
        return spec, []
    ran = replace(spec, training=replace(spec.training, **{n: v for n, _, v in changes}))
    return ran, [f"training.{n} = {mine!r} -> {theirs!r}" for n, mine, theirs in changes]


def _changes(spec: RunSpec) -> list[tuple[str, Any, Any]]:
    t = spec.training
    fixed = dict(FIXED)
    if t.precision != "fp8":
        fixed.pop("fp8_saved_inputs", None)
    out = [(k, getattr(t, k), v) for k, v in fixed.items() if getattr(t, k) != v]
    if t.tp_comm_overlap not in ("none", "async_tp"):
        out.append(("tp_comm_overlap", t.tp_comm_overlap, "none"))
    if t.cross_entropy != ("fused" if t.fused_kernels else "eager"):
        out.append(("cross_entropy", t.cross_entropy, "fused" if t.fused_kernels else "eager"))
    return out


def _flavor(spec: RunSpec) -> str:
    mine = model_fields(spec.model)
    for flavor in FLAVORS:
        shape = flavor_shape(flavor, spec.model.seq_length)
        if model_fields(from_table(ModelSpec, shape, "model")) == mine:
            return flavor
    raise SpecError(
        "model",
        spec.model.name,
        f"torchtitan {VERSION} trains the llama3 flavors " + ", ".join(FLAVORS) + " only",
    )


def export_torchtitan(spec: RunSpec, source: str = "") -> tuple[str, list[str]]:
    """(a torchtitan v0.2.0 job TOML, run-spec fields it cannot carry); a plan torchtitan
    cannot run raises SpecError naming the field."""
    m, p, t, ck = spec.model, spec.plan(), spec.training, spec.checkpoint
    flavor = _flavor(spec)
    err = torchtitan_refusal(m, p, t)
    if err is not None:
        raise err
    par, local = _parallelism(spec)
    ac = (
        {"mode": p.recompute}
        if p.recompute != "op"
        else {"mode": "selective", "selective_ac_option": "op"}
    )
    model: dict[str, Any] = {"name": "llama3", "flavor": flavor}
    if t.precision == "fp8":  # torchtitan 0.2's converter name (components/quantization)
        model["converters"] = ["quantize.linear.float8"]
    data: dict[str, Any] = {
        "job": {"description": f"{m.name} on {spec.cluster.num_gpus} x {spec.cluster.gpu.id}"},
        "model": model,
        "optimizer": {
            "name": "AdamW" if t.optimizer == "adamw" else "Adam",
            "lr": t.learning_rate,
            "beta1": t.adam_beta1,
            "beta2": t.adam_beta2,
            "weight_decay": t.weight_decay,
        },
        "lr_scheduler": {
            "warmup_steps": t.warmup_steps,
            "decay_type": "cosine",
            "min_lr_factor": t.min_lr_ratio,
        },
        "training": {
            "local_batch_size": local,
            "global_batch_size": p.global_batch_size,
            "seq_len": m.seq_length,
            "max_norm": t.grad_clip,
            "steps": t.train_steps,
            "seed": t.seed,
            "mixed_precision_param": "bfloat16",
        },
        "parallelism": par,
        "activation_checkpoint": ac,
        "compile": {"enable": t.fused_kernels},
        "metrics": {"log_freq": t.log_interval},
        "checkpoint": {
            "enable": True,
            "interval": ck.interval_steps,
            "keep_latest_k": ck.keep_last,
            "async_mode": "async" if ck.async_save else "disabled",
        },
    }
    if t.precision == "fp8":
        data["quantize"] = {"linear": {"float8": _float8(t.fp8_param_gather)}}
    if t.tp_comm_overlap == "async_tp":
        par["enable_async_tensor_parallel"] = True
    header = (
        f"torchtitan {VERSION} job config (--job.config_file) written by "
        f"`aihpc export{' ' + source if source else ''} --to torchtitan`"
    )
    return dumps_toml(data, header), _dropped(spec)


def _float8(param_gather: bool) -> dict[str, Any]:
    """[quantize.linear.float8] (torchtitan 0.2's Float8Linear; before 0.2, [float8]): per-tensor
    scaling, the output layer kept 16-bit as torchtitan's own llama3 FP8 configs do, FP8
    all-gather under FSDP2 with its precomputed scales when the run spec gathers FP8."""
    table: dict[str, Any] = {"recipe_name": "tensorwise", "filter_fqns": ["output"]}
    if param_gather:
        table["enable_fsdp_float8_all_gather"] = True
        table["precompute_float8_dynamic_scale_for_fsdp"] = True
    return table


def _dropped(spec: RunSpec) -> list[str]:
    """The run spec's [training] values torchtitan cannot take (it runs its own instead)."""
    t = spec.training
    dropped = not_carried(spec, FIXED, FRAMEWORK)
    if t.tp_comm_overlap not in ("none", "async_tp"):  # vanilla DTensor TP, or async TP
        dropped.append(
            f"training.tp_comm_overlap = {t.tp_comm_overlap!r} ({FRAMEWORK} runs 'none' or "
            "'async_tp')"
        )
    if t.cross_entropy != ("fused" if t.fused_kernels else "eager"):
        dropped.append(
            f"training.cross_entropy = {t.cross_entropy!r} (torchtitan: compile decides)"
        )
    return dropped


def torchtitan_refusal(model: ModelSpec, p: ParallelPlan, t: TrainingSpec) -> SpecError | None:
    """The first field of the plan torchtitan cannot run, as a SpecError; None if it runs it
    (the model's flavor aside: ``export_torchtitan`` checks it). Shared by the export and
    `aihpc search --for torchtitan`; depends on neither batch size."""
    del model  # every llama3 flavor runs the same plans
    if p.sequence_parallel != (p.tp > 1):
        return SpecError(
            "parallel.sequence_parallel",
            p.sequence_parallel,
            "torchtitan shards the sequence whenever tp > 1",
        )
    if p.zero_stage == 1:
        return SpecError("parallel.zero_stage", 1, "torchtitan runs 0 (DDP) | 2 | 3 (FSDP2)")
    if p.recompute == "selective":
        return SpecError("parallel.recompute", "selective", "torchtitan runs none | op | full")
    if p.offload_layers:
        return SpecError(
            "parallel.offload_layers", p.offload_layers, "torchtitan offloads no activations"
        )
    if p.ep > 1:
        return SpecError("parallel.ep", p.ep, "llama3 is dense")
    return torchtitan_training_refusal(t)


def torchtitan_training_refusal(t: TrainingSpec) -> SpecError | None:
    """What torchtitan refuses in the training whatever the plan."""
    if t.precision == "fp16":
        return SpecError("training.precision", "fp16", "torchtitan trains bf16 | fp8")
    if t.optimizer == "sgd":
        return SpecError("training.optimizer", "sgd", "torchtitan runs adamw | adam")
    if t.tp_comm_overlap == "async_tp" and not t.fused_kernels:
        return SpecError(
            "training.tp_comm_overlap", "async_tp", "torchtitan runs async TP compiled only"
        )
    return None


def _parallelism(spec: RunSpec) -> tuple[dict[str, Any], int]:
    """([parallelism] of the job TOML, training.local_batch_size)."""
    m, p, t = spec.model, spec.plan(), spec.training
    shard = 1 if p.zero_stage == 0 else p.shard_group
    par: dict[str, Any] = {
        "data_parallel_replicate_degree": p.dp // shard,
        "data_parallel_shard_degree": shard,
        "tensor_parallel_degree": p.tp,
        "pipeline_parallel_degree": p.pp,
        "context_parallel_degree": p.cp,
        "context_parallel_rotate_method": "allgather"
        if t.cp_exchange == "allgather"
        else "alltoall",
    }
    if p.zero_stage == 2:
        par["fsdp_reshard_after_forward"] = "never"
    local = p.micro_batch_size
    if p.pp > 1:
        local = p.global_batch_size // p.dp
        name = {v: k for k, v in SCHEDULES.items()}[p.schedule]
        par["pipeline_parallel_schedule"] = name
        par["pipeline_parallel_microbatch_size"] = p.micro_batch_size
        par.update(_layers_per_stage(m.num_layers, p.pp, p.vpp, p.schedule))
    return par, local


def _layers_per_stage(num_layers: int, pp: int, vpp: int, schedule: str) -> dict[str, Any]:
    """pipeline_parallel_layers_per_stage giving pp x vpp stages, as torchtitan counts them
    (the embedding and the output each weigh one layer), or nothing where its default does."""
    default = 1 if schedule == "1f1b" else 2
    if vpp == default:
        return {}
    total = num_layers + 2
    for per_stage in range(1, total + 1):
        if -(-total // per_stage) == pp * vpp:
            return {"pipeline_parallel_layers_per_stage": per_stage}
    # no uniform size gives that many stages: name each stage's modules
    stages, extra = divmod(num_layers, pp * vpp)
    parts, first = [], 0
    for i in range(pp * vpp):
        n = stages + (i < extra)
        parts.append([f"layers.{j}" for j in range(first, first + n)])
        first += n
    parts[0].insert(0, "tok_embeddings")
    parts[-1] += ["norm", "output"]
    return {"module_fqns_per_model_part": parts}
