"""torchtitan → run spec: a job TOML read with torchtitan v0.2.0's own defaults.

Sections, field names and defaults are torchtitan v0.2.0's (``torchtitan/config/job_config.py``,
the last release that reads ``--job.config_file`` TOML; v0.3.0 moved to Python config
functions). Defaults applied: training.local_batch_size 8, global_batch_size -1 (= local x dp),
seq_len 2048, max_norm 1.0, steps 10000, mixed_precision_param bfloat16; parallelism
data_parallel_shard_degree -1 (the ranks left), all other degrees 1, pipeline schedule 1F1B,
pipeline_parallel_microbatch_size 1, context_parallel_rotate_method allgather;
activation_checkpoint mode selective with selective_ac_option "2"; optimizer AdamW lr 8e-4,
betas 0.9 / 0.95, weight_decay 0.1; lr_scheduler warmup_steps 200, min_lr_factor 0;
checkpoint interval 500, keep_latest_k 10; metrics log_freq 10.
"""

from __future__ import annotations

from typing import Any

from aihpc.interop._common import (
    Imported,
    as_float,
    as_int,
    cluster_table,
    model_table,
)
from aihpc.interop.torchtitan.flavors import FIXED, FLAVORS, FRAMEWORK, SCHEDULES, flavor_shape
from aihpc.runspec import SpecError
from aihpc.runspec.inputs import parse_toml

__all__ = ["import_torchtitan"]


_KIND_NAMES = {str: "a string", int: "an integer", list: "a list"}


class _Toml:
    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.read: set[tuple[str, str]] = set()

    def get(self, section: str, key: str, default: Any = None, kind: type | None = None) -> Any:
        """``[section] key``; with ``kind`` (str, int, list), a value of another kind is one
        line naming it (a list where a name is read was a traceback, issue 42)."""
        self.read.add((section, key))
        table = self.data.get(section, {})
        value = table.get(key, default) if isinstance(table, dict) else default
        if kind is not None and value is not None:
            wrong = isinstance(value, bool) if kind is int else False
            if wrong or not isinstance(value, kind):
                raise SpecError(f"{section}.{key}", value, f"expected {_KIND_NAMES[kind]}")
        return value

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
    for n, v in zip((*names, "data_parallel_replicate_degree"), (tp, pp, cp, rep), strict=True):
        if v < 1:
            raise SpecError(f"parallelism.{n}", v, "a degree >= 1")
    if shard < 1 and shard != -1:
        raise SpecError("parallelism.data_parallel_shard_degree", shard, "a degree >= 1, or -1")
    if num_gpus is not None and num_gpus < 1:
        raise SpecError("--num-gpus", num_gpus, "a positive integer")
    if shard == -1:
        if num_gpus is None:
            raise SpecError(
                "parallelism.data_parallel_shard_degree",
                -1,
                "-1 takes the GPUs left, and the TOML does not say how many: pass --num-gpus N",
            )
        # ParallelDims: dp_shard = world // (dp_replicate x cp x tp x pp), which must come out
        # a whole degree >= 1 (its _validate asserts the product equals the world size)
        rest = rep * tp * pp * cp
        if num_gpus % rest:
            raise SpecError(
                "parallelism.data_parallel_shard_degree",
                -1,
                f"torchtitan resolves -1 to world / (replicate x tp x pp x cp) = {num_gpus} / "
                f"{rest}, not a whole degree >= 1: pass the --num-gpus the job runs on",
            )
        shard = num_gpus // rest
    world = rep * shard * tp * pp * cp
    if num_gpus is not None and num_gpus != world:
        raise SpecError("--num-gpus", num_gpus, f"the TOML's degrees multiply to {world}")
    return {"tp": tp, "pp": pp, "cp": cp, "rep": rep, "shard": shard}, world


def _pipeline(t: _Toml, pp: int, num_layers: int) -> tuple[int, str | None]:
    name = t.get("parallelism", "pipeline_parallel_schedule", "1F1B", str)
    if name not in SCHEDULES:
        raise SpecError(
            "parallelism.pipeline_parallel_schedule", name, "aihpc prices " + " | ".join(SCHEDULES)
        )
    if pp == 1:
        return 1, None
    single = SCHEDULES[name] == "1f1b"
    per_stage = t.get("parallelism", "pipeline_parallel_layers_per_stage", None, int)
    first = t.get("parallelism", "pipeline_parallel_first_stage_less_layers", 1, int)
    last = t.get("parallelism", "pipeline_parallel_last_stage_less_layers", 1, int)
    parts = t.get("parallelism", "module_fqns_per_model_part", None, list)
    if per_stage is not None and per_stage < 1:
        raise SpecError("parallelism.pipeline_parallel_layers_per_stage", per_stage, "at least 1")
    if parts:
        stages = len(parts) // pp
    elif per_stage is None:
        stages = 1 if single else 2  # torchtitan's default stages per rank
    else:
        stages = -(-(num_layers + first + last) // per_stage) // pp
    return stages, SCHEDULES[name]


def _recompute(t: _Toml, notes: list[str]) -> str:
    mode = t.get("activation_checkpoint", "mode", "selective", str)
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
    t = _Toml(parse_toml(text, "SOURCE", "torchtitan TOML"))
    notes: list[str] = []
    name = t.get("model", "name", "llama3", str)
    flavor = t.get("model", "flavor", "debugmodel", str)
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
    mbs = (
        t.get("parallelism", "pipeline_parallel_microbatch_size", 1, int) if d["pp"] > 1 else local
    )
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
    training.update(_moe_stack(t, parallel["ep"]))
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


# parallelism.expert_parallel_comm_backend -> training.moe_stack (torchtitan's parallelize: the
# backend falls back to "standard" when EP is off)
_EP_BACKENDS = {"standard": "torch-native", "deepep": "torch-deepep", "hybridep": "torch-hybridep"}


def _moe_stack(t: _Toml, ep: int) -> dict[str, Any]:
    backend = t.get("parallelism", "expert_parallel_comm_backend", "standard", str)
    if backend not in _EP_BACKENDS:
        allowed = " | ".join(_EP_BACKENDS)
        raise SpecError("parallelism.expert_parallel_comm_backend", backend, f"allowed: {allowed}")
    return {"moe_stack": _EP_BACKENDS[backend]} if ep > 1 else {}


def _cp_and_precision(t: _Toml, notes: list[str]) -> dict[str, Any]:
    rotate = t.get("parallelism", "context_parallel_rotate_method", "allgather", str)
    if rotate not in ("allgather", "alltoall"):
        raise SpecError(
            "parallelism.context_parallel_rotate_method", rotate, "allowed: allgather | alltoall"
        )
    param = t.get("training", "mixed_precision_param", "bfloat16")
    if param != "bfloat16":
        raise SpecError("training.mixed_precision_param", param, "aihpc prices bfloat16 training")
    t.get("training", "mixed_precision_reduce")
    converters = t.get("model", "converters", [], list) or []
    # torchtitan 0.2 names the converter quantize.linear.float8 and reads its options from
    # [quantize.linear.float8]; before 0.2 both were float8 / [float8]
    fp8 = "float8" in converters or "quantize.linear.float8" in converters
    gather = bool(t.get("float8", "enable_fsdp_float8_all_gather", False))
    quantize = t.data.get("quantize")
    linear = quantize.get("linear") if isinstance(quantize, dict) else None
    table = linear.get("float8") if isinstance(linear, dict) else None
    if isinstance(table, dict):
        gather = gather or bool(table.get("enable_fsdp_float8_all_gather", False))
        known = {"enable_fsdp_float8_all_gather", "precompute_float8_dynamic_scale_for_fsdp"}
        known |= {"recipe_name", "filter_fqns", "emulate", "force_recompute_fp8_weight_in_bwd"}
        if set(table) <= known and set(linear) == {"float8"} and set(quantize) == {"linear"}:
            t.read.add(("quantize", "linear"))
    compiled = bool(t.get("compile", "enable", t.get("training", "compile", False)))
    # async TP: Inductor's micro-pipelined all-gather-matmul / matmul-reduce-scatter; vanilla
    # DTensor TP overlaps nothing (perf/step/tp_overlap.py)
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
    opt = t.get("optimizer", "name", "AdamW", str)
    if opt not in ("AdamW", "Adam"):
        raise SpecError("optimizer.name", opt, "allowed: AdamW | Adam")
    lr = as_float(t.get("optimizer", "lr", 8e-4), "optimizer.lr")
    out = {
        **numerics,
        "optimizer": opt.lower(),
        "learning_rate": lr,
        "min_lr_ratio": as_float(
            t.get("lr_scheduler", "min_lr_factor", t.get("lr_scheduler", "lr_min", 0.0)),
            "lr_scheduler.min_lr_factor",
        ),
        "warmup_steps": as_int(
            t.get("lr_scheduler", "warmup_steps", 200), "lr_scheduler.warmup_steps"
        ),
        "weight_decay": as_float(t.get("optimizer", "weight_decay", 0.1), "optimizer.weight_decay"),
        "adam_beta1": as_float(t.get("optimizer", "beta1", 0.9), "optimizer.beta1"),
        "adam_beta2": as_float(t.get("optimizer", "beta2", 0.95), "optimizer.beta2"),
        "grad_clip": as_float(t.get("training", "max_norm", 1.0), "training.max_norm"),
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
