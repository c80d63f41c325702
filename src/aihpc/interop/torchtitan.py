"""torchtitan job TOML ⇄ run spec.

Sections, field names and defaults are torchtitan v0.2.0's (``torchtitan/config/job_config.py``,
the last release that reads ``--job.config_file`` TOML; v0.3.0 moved to Python config
functions). Defaults applied: training.local_batch_size 8, global_batch_size -1 (= local x dp),
seq_len 2048, max_norm 1.0, steps 10000, mixed_precision_param bfloat16; parallelism
data_parallel_shard_degree -1 (the ranks left), all other degrees 1, pipeline schedule 1F1B,
pipeline_parallel_microbatch_size 1, context_parallel_rotate_method allgather;
activation_checkpoint mode selective with selective_ac_option "2"; optimizer AdamW lr 8e-4,
betas 0.9 / 0.95, weight_decay 0.1; lr_scheduler warmup_steps 200, min_lr_factor 0;
checkpoint interval 500, keep_latest_k 10; metrics log_freq 10. Model shapes are the llama3
flavors of ``torchtitan/models/llama3/__init__.py`` (FFN size from ffn_dim_multiplier and
multiple_of, as its FeedForward computes it).
"""

from __future__ import annotations

import tomllib
from typing import Any

from aihpc.interop._common import (
    Imported,
    as_int,
    cluster_table,
    model_fields,
    model_table,
    not_carried,
)
from aihpc.spec import RunSpec, SpecError
from aihpc.spec._table import from_table
from aihpc.spec.model import ModelSpec
from aihpc.spec.tomlw import dumps_toml

__all__ = ["FIXED", "FLAVORS", "export_torchtitan", "import_torchtitan"]

FRAMEWORK = "torchtitan"
VERSION = "v0.2.0"
# (dim, n_layers, n_heads, n_kv_heads, ffn_dim_multiplier, multiple_of, vocab_size)
FLAVORS: dict[str, tuple[int, int, int, int | None, float | None, int, int]] = {
    "debugmodel": (256, 6, 16, None, None, 256, 2048),
    "8B": (4096, 32, 32, 8, 1.3, 1024, 128256),
    "70B": (8192, 80, 64, 8, 1.3, 4096, 128256),
    "405B": (16384, 126, 128, 8, 1.2, 4096, 128256),
}
SCHEDULES = {"1F1B": "1f1b", "Interleaved1F1B": "interleaved-1f1b", "ZBVZeroBubble": "zbv"}
FIXED: dict[str, Any] = {
    "pipeline_split": "uneven",  # split points may leave stages a layer apart
    "attention": "flash2",  # PyTorch SDPA's flash backend
    "kv_repeat": True,  # repeat_kv ahead of SDPA
    "optimizer_dtype": "fp32",
    "grad_reduce_dtype": "fp32",  # mixed_precision_reduce: float32 is its only choice
    "grad_reduce_overlap": True,
    "fp8_saved_inputs": "bf16",  # torchao's Float8Linear keeps the 16-bit input
    "dropout": 0.0,
    "zero3_gather": "bucketed",
}


def _ffn(dim: int, multiplier: float | None, multiple_of: int) -> int:
    hidden = int(2 * 4 * dim / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * (-(-hidden // multiple_of))


def flavor_shape(flavor: str, seq_len: int) -> dict[str, Any]:
    dim, layers, heads, kv, mult, multiple, vocab = FLAVORS[flavor]
    shape = {
        "num_layers": layers,
        "hidden_size": dim,
        "num_attention_heads": heads,
        "ffn_hidden_size": _ffn(dim, mult, multiple),
        "ffn_activation": "swiglu",
        "vocab_size": vocab,
        "seq_length": seq_len,
        "tied_embeddings": False,
        "position_embedding": "rope",
    }
    if kv is not None:
        shape["num_kv_heads"] = kv
    return shape


class _Toml:
    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.read: set[tuple[str, str]] = set()

    def get(self, section: str, key: str, default: Any = None) -> Any:
        self.read.add((section, key))
        table = self.data.get(section, {})
        return table.get(key, default) if isinstance(table, dict) else default

    def unread(self) -> list[str]:
        out = []
        for section, table in self.data.items():
            if not isinstance(table, dict):
                out.append(section)
                continue
            out += [f"{section}.{k}" for k in table if (section, k) not in self.read]
        return out


def _degrees(t: _Toml, num_gpus: int | None) -> tuple[dict[str, int], int]:
    names = ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree")
    tp, pp, cp = (as_int(t.get("parallelism", n, 1), f"parallelism.{n}") for n in names)
    rep = as_int(
        t.get("parallelism", "data_parallel_replicate_degree", 1),
        "parallelism.data_parallel_replicate_degree",
    )
    shard = as_int(
        t.get("parallelism", "data_parallel_shard_degree", -1),
        "parallelism.data_parallel_shard_degree",
    )
    if shard == -1:
        if num_gpus is None:
            raise SpecError(
                "parallelism.data_parallel_shard_degree",
                -1,
                "-1 takes the GPUs left, and the TOML does not say how many: pass --num-gpus N",
            )
        shard = num_gpus // (rep * tp * pp * cp)
    world = rep * shard * tp * pp * cp
    if num_gpus is not None and num_gpus != world:
        raise SpecError("--num-gpus", num_gpus, f"the TOML's degrees multiply to {world}")
    return {"tp": tp, "pp": pp, "cp": cp, "rep": rep, "shard": shard}, world


def _pipeline(t: _Toml, pp: int, num_layers: int) -> tuple[int, str | None]:
    name = t.get("parallelism", "pipeline_parallel_schedule", "1F1B")
    if name not in SCHEDULES:
        raise SpecError(
            "parallelism.pipeline_parallel_schedule", name, "aihpc prices " + " | ".join(SCHEDULES)
        )
    if pp == 1:
        return 1, None
    single = SCHEDULES[name] == "1f1b"
    per_stage = t.get("parallelism", "pipeline_parallel_layers_per_stage")
    first = t.get("parallelism", "pipeline_parallel_first_stage_less_layers", 1)
    last = t.get("parallelism", "pipeline_parallel_last_stage_less_layers", 1)
    parts = t.get("parallelism", "module_fqns_per_model_part")
    if parts:
        stages = len(parts) // pp
    elif per_stage is None:
        stages = 1 if single else 2  # torchtitan's default stages per rank
    else:
        stages = -(-(num_layers + first + last) // per_stage) // pp
    return stages, SCHEDULES[name]


def _recompute(t: _Toml, notes: list[str]) -> str:
    mode = t.get("activation_checkpoint", "mode", "selective")
    option = str(t.get("activation_checkpoint", "selective_ac_option", "2"))
    if mode in ("none", "full"):
        return mode
    if mode != "selective":
        raise SpecError("activation_checkpoint.mode", mode, "allowed: none | selective | full")
    if option == "op":
        return "op"
    notes.append(
        f'activation_checkpoint selective_ac_option "{option}" (every {option}th layer checkpointed'
        " in full) priced as full recompute of every layer"
    )
    return "full"


def import_torchtitan(
    text: str, gpu: str = "h100-sxm", num_gpus: int | None = None, gpus_per_node: int | None = None
) -> Imported:
    """A torchtitan (v0.2.0) job TOML → run spec."""
    try:
        t = _Toml(tomllib.loads(text))
    except tomllib.TOMLDecodeError as err:
        raise SpecError("SOURCE", "torchtitan TOML", f"not valid TOML: {err}") from None
    notes: list[str] = []
    name = t.get("model", "name", "llama3")
    flavor = t.get("model", "flavor", "debugmodel")
    if name != "llama3" or flavor not in FLAVORS:
        raise SpecError(
            "model.flavor", f"{name} {flavor}", "aihpc reads llama3 " + " | ".join(FLAVORS)
        )
    seq_len = as_int(t.get("training", "seq_len", 2048), "training.seq_len")
    shape = flavor_shape(flavor, seq_len)
    d, world = _degrees(t, num_gpus)
    vpp, schedule = _pipeline(t, d["pp"], shape["num_layers"])
    dp = d["rep"] * d["shard"]
    local = as_int(t.get("training", "local_batch_size", 8), "training.local_batch_size")
    gbs = as_int(t.get("training", "global_batch_size", -1), "training.global_batch_size")
    gbs = local * dp if gbs <= 0 else gbs
    mbs = t.get("parallelism", "pipeline_parallel_microbatch_size", 1) if d["pp"] > 1 else local
    reshard = t.get("parallelism", "fsdp_reshard_after_forward", "default")
    zero = 0 if d["shard"] == 1 else 2 if reshard == "never" else 3
    parallel: dict[str, Any] = {
        "tp": d["tp"],
        "pp": d["pp"],
        "vpp": vpp,
        "cp": d["cp"],
        "dp": dp,
        "ep": as_int(
            t.get("parallelism", "expert_parallel_degree", 1), "parallelism.expert_parallel_degree"
        ),
        "sequence_parallel": d["tp"] > 1,  # torchtitan's TP always shards norms' sequence
        "zero_stage": zero,
        "recompute": _recompute(t, notes),
        "micro_batch_size": mbs,
        "global_batch_size": gbs,
    }
    if schedule is not None:
        parallel["pp_schedule"] = schedule
    if zero and d["rep"] > 1:
        parallel["dp_shard"] = d["shard"]
    parallel.update(_cp_and_precision(t, notes))
    training = _training(t, parallel.pop("_training"))
    tables: dict[str, dict[str, Any]] = {
        "model": model_table(shape),
        "cluster": cluster_table(gpu, world, gpus_per_node),
        "parallel": parallel,
        "training": training,
    }
    if t.get("checkpoint", "enable", t.get("checkpoint", "enable_checkpoint", False)):
        tables["checkpoint"] = {
            "interval_steps": as_int(t.get("checkpoint", "interval", 500), "checkpoint.interval"),
            "keep_last": as_int(
                t.get("checkpoint", "keep_latest_k", 10), "checkpoint.keep_latest_k"
            ),
            "async_save": t.get("checkpoint", "async_mode", "disabled") != "disabled",
        }
    for key in ("folder", "interval", "keep_latest_k", "async_mode"):
        t.get("checkpoint", key)
    return Imported(FRAMEWORK, tables, t.unread(), notes)


def _cp_and_precision(t: _Toml, notes: list[str]) -> dict[str, Any]:
    rotate = t.get("parallelism", "context_parallel_rotate_method", "allgather")
    if rotate not in ("allgather", "alltoall"):
        raise SpecError(
            "parallelism.context_parallel_rotate_method", rotate, "allowed: allgather | alltoall"
        )
    param = t.get("training", "mixed_precision_param", "bfloat16")
    if param != "bfloat16":
        raise SpecError("training.mixed_precision_param", param, "aihpc prices bfloat16 training")
    t.get("training", "mixed_precision_reduce")
    converters = t.get("model", "converters", []) or []
    fp8 = "float8" in converters
    gather = bool(t.get("float8", "enable_fsdp_float8_all_gather", False))
    compiled = bool(t.get("compile", "enable", t.get("training", "compile", False)))
    # async TP: Inductor's micro-pipelined all-gather-matmul / matmul-reduce-scatter; vanilla
    # DTensor TP overlaps nothing (perf/tp_overlap.py)
    async_tp = bool(t.get("parallelism", "enable_async_tensor_parallel", False))
    return {
        "_training": {
            "precision": "fp8" if fp8 else "bf16",
            "cp_exchange": "allgather" if rotate == "allgather" else "ring",
            "fp8_param_gather": fp8 and gather,
            # torch.compile fuses the element-wise ops and the loss; eager runs them one by one
            "fused_kernels": compiled,
            "cross_entropy": "fused" if compiled else "eager",
            "tp_comm_overlap": "async_tp" if async_tp else "none",
        }
    }


def _training(t: _Toml, numerics: dict[str, Any]) -> dict[str, Any]:
    opt = t.get("optimizer", "name", "AdamW")
    if opt not in ("AdamW", "Adam"):
        raise SpecError("optimizer.name", opt, "allowed: AdamW | Adam")
    lr = float(t.get("optimizer", "lr", 8e-4))
    out = {
        **numerics,
        "optimizer": opt.lower(),
        "learning_rate": lr,
        "min_lr_ratio": float(
            t.get("lr_scheduler", "min_lr_factor", t.get("lr_scheduler", "lr_min", 0.0))
        ),
        "warmup_steps": as_int(
            t.get("lr_scheduler", "warmup_steps", 200), "lr_scheduler.warmup_steps"
        ),
        "weight_decay": float(t.get("optimizer", "weight_decay", 0.1)),
        "adam_beta1": float(t.get("optimizer", "beta1", 0.9)),
        "adam_beta2": float(t.get("optimizer", "beta2", 0.95)),
        "grad_clip": float(t.get("training", "max_norm", 1.0)),
        "train_steps": as_int(t.get("training", "steps", 10000), "training.steps"),
        "log_interval": as_int(t.get("metrics", "log_freq", 10), "metrics.log_freq"),
        **{k: v for k, v in FIXED.items() if k not in numerics},
    }
    seed = t.get("training", "seed", t.get("debug", "seed"))
    if seed is not None:
        out["seed"] = as_int(seed, "training.seed")
    scheduler = t.data.get("lr_scheduler")
    if isinstance(scheduler, dict) and scheduler.get("decay_type") == "cosine":
        t.get("lr_scheduler", "decay_type")  # what aihpc's trainer runs; others: not priced
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
    _refuse_torchtitan(spec)
    par, local = _parallelism(spec)
    ac = (
        {"mode": p.recompute}
        if p.recompute != "op"
        else {"mode": "selective", "selective_ac_option": "op"}
    )
    model: dict[str, Any] = {"name": "llama3", "flavor": flavor}
    if t.precision == "fp8":
        model["converters"] = ["float8"]
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
    if t.fp8_param_gather:
        data["float8"] = {"enable_fsdp_float8_all_gather": True}
    if t.tp_comm_overlap == "async_tp":
        par["enable_async_tensor_parallel"] = True
    header = (
        f"torchtitan {VERSION} job config (--job.config_file) written by "
        f"`aihpc export{' ' + source if source else ''} --to torchtitan`"
    )
    return dumps_toml(data, header), _dropped(spec)


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


def _refuse_torchtitan(spec: RunSpec) -> None:
    """SpecError naming the first field of the plan torchtitan cannot run."""
    p, t = spec.plan(), spec.training
    if p.sequence_parallel != (p.tp > 1):
        raise SpecError(
            "parallel.sequence_parallel",
            p.sequence_parallel,
            "torchtitan shards the sequence whenever tp > 1",
        )
    if p.zero_stage == 1:
        raise SpecError("parallel.zero_stage", 1, "torchtitan runs 0 (DDP) | 2 | 3 (FSDP2)")
    if p.recompute == "selective":
        raise SpecError("parallel.recompute", "selective", "torchtitan runs none | op | full")
    if p.offload_layers:
        raise SpecError(
            "parallel.offload_layers", p.offload_layers, "torchtitan offloads no activations"
        )
    if p.ep > 1:
        raise SpecError("parallel.ep", p.ep, "llama3 is dense")
    if t.precision == "fp16":
        raise SpecError("training.precision", "fp16", "torchtitan trains bf16 | fp8")
    if t.optimizer == "sgd":
        raise SpecError("training.optimizer", "sgd", "torchtitan runs adamw | adam")
    if t.tp_comm_overlap == "async_tp" and not t.fused_kernels:
        raise SpecError(
            "training.tp_comm_overlap", "async_tp", "torchtitan runs async TP compiled only"
        )


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
