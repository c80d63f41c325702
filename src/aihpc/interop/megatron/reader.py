"""Megatron-LM → run spec: a pretrain_gpt.py launch script (or a file of its arguments) read
with Megatron-LM's own defaults; the plan, the precision, the schedule, the MoE dispatcher and
the software facts it states. Flags it does not price are named in a warning.
"""

from __future__ import annotations

from typing import Any

from aihpc.interop._common import (
    Imported,
    cluster_table,
    model_table,
    require,
)
from aihpc.interop.megatron.flags import (
    FIXED,
    FRAMEWORK,
    Args,
    launcher_counts,
    parse_flags,
    source_words,
)
from aihpc.interop.megatron.shape import model_shape
from aihpc.runspec import SpecError
from aihpc.runspec.parallel import RECOMPUTE_MODULES

__all__ = ["import_megatron"]


_FSDP_ZERO = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}


def _zero(a: Args, notes: list[str]) -> int:
    """The ZeRO stage: Megatron-FSDP's --data-parallel-sharding-strategy (default no_shard;
    optim | optim_grads | optim_grads_params shard what ZeRO 1 | 2 | 3 shard), torch FSDP2
    (ZeRO 3), the distributed optimizer (ZeRO 1), else DDP."""
    fsdp = a.flag("--use-megatron-fsdp") or a.flag("--use-custom-fsdp")
    strategy = a.get("--data-parallel-sharding-strategy", "no_shard")
    if fsdp:
        if not isinstance(strategy, str) or strategy not in _FSDP_ZERO:
            allowed = " | ".join(_FSDP_ZERO)
            raise SpecError("--data-parallel-sharding-strategy", strategy, f"allowed: {allowed}")
        if not a.flags.get("--data-parallel-sharding-strategy"):
            notes.append("Megatron-FSDP without --data-parallel-sharding-strategy: no_shard")
        return _FSDP_ZERO[strategy]
    if a.flag("--use-torch-fsdp2"):
        return 3
    return 1 if a.flag("--use-distributed-optimizer") else 0


def _megatron_rules(
    a: Args, out: dict[str, Any], num_layers: int, world: int, notes: list[str]
) -> str | None:
    """What Megatron-LM turns off or refuses (arguments.py validate_args; parallel_state's
    initialize_model_parallel for the expert groups)."""
    if out["sequence_parallel"] and out["tp"] == 1:
        # validate_args: "Disabling sequence parallelism because tensor model parallelism is
        # disabled"
        out["sequence_parallel"] = False
        notes.append("--sequence-parallel with tp 1: Megatron-LM turns it off (read as off)")
    ep, etp, pp = out["ep"], out["etp"], out["pp"]
    if ep > 1 and world % (etp * ep * pp):
        raise SpecError(
            "--expert-model-parallel-size",
            ep,
            f"Megatron-LM refuses it: the world size {world} is not divisible by expert tensor "
            f"x expert model x pipeline parallel size {etp} x {ep} x {pp}",
        )
    custom = [
        f
        for f in (
            "--pipeline-model-parallel-layout",
            "--decoder-first-pipeline-num-layers",
            "--decoder-last-pipeline-num-layers",
            "--account-for-embedding-in-pipeline-split",
            "--account-for-loss-in-pipeline-split",
        )
        if a.flag(f)
    ]
    if custom:
        notes.append(f"{custom[0]}: Megatron-LM's stages may differ, priced as an uneven split")
        return "uneven"
    chunks = pp * out["vpp"]
    if pp > 1 and num_layers % chunks:
        raise SpecError(
            "--pipeline-model-parallel-size",
            pp,
            f"Megatron-LM refuses it: num_layers {num_layers} is not divisible by the "
            f"{chunks} pipeline stages{' x virtual stages' if out['vpp'] > 1 else ''} (an "
            "uneven split needs --pipeline-model-parallel-layout or "
            "--decoder-first/last-pipeline-num-layers)",
        )
    return None


def _parallel(a: Args, num_layers: int, world: int, moe: bool, notes: list[str]) -> dict[str, Any]:
    tp = a.int("--tensor-model-parallel-size", 1)
    pp = a.int("--pipeline-model-parallel-size", 1)
    cp = a.int("--context-parallel-size", 1)
    mbs = require(a.int("--micro-batch-size"), "--micro-batch-size", "required by Megatron-LM")
    if world % (tp * pp * cp):
        # parallel_state.initialize_model_parallel: the world must split into tp x pp x cp
        # groups; a plan that does not gets dp = 0, which named neither the GPUs nor the degrees
        raise SpecError(
            "--tensor-model-parallel-size",
            tp,
            f"Megatron-LM refuses it: the world size {world} is not divisible by tensor x "
            f"pipeline x context parallel size {tp} x {pp} x {cp} = {tp * pp * cp}",
        )
    dp = world // (tp * pp * cp)
    vpp = a.int("--num-virtual-stages-per-pipeline-rank")
    per_stage = a.int("--num-layers-per-virtual-pipeline-stage")
    if per_stage:
        if num_layers % (per_stage * pp):
            raise SpecError(
                "--num-layers-per-virtual-pipeline-stage",
                per_stage,
                f"x pp {pp} must divide num_layers {num_layers}",
            )
        vpp = num_layers // (per_stage * pp)
    zero = _zero(a, notes)
    granularity = a.get("--recompute-granularity")
    choices = {None: "none", "selective": "selective", "full": "full"}
    recompute = choices.get(granularity) if not isinstance(granularity, list) else None
    if recompute is None:
        raise SpecError("--recompute-granularity", granularity, "allowed: selective | full")
    modules = a.get("--recompute-modules")
    modules = [] if modules is None else modules if isinstance(modules, list) else [modules]
    fine: list[str] = []
    if recompute == "selective":  # transformer_config.py: recompute_modules default core_attn
        modules = modules or ["core_attn"]
        recompute = "selective" if "core_attn" in modules else "none"
        fine = [m for m in modules if m != "core_attn"]
        for m in fine:
            if m not in RECOMPUTE_MODULES:
                allowed = "aihpc prices core_attn | " + " | ".join(RECOMPUTE_MODULES)
                raise SpecError("--recompute-modules", m, allowed)
    out = {
        "tp": tp,
        "pp": pp,
        "vpp": vpp or 1,
        "cp": cp,
        "dp": dp,
        "ep": a.int("--expert-model-parallel-size", 1),
        # arguments.py: expert_tensor_parallel_size defaults to tensor_model_parallel_size
        "etp": a.int("--expert-tensor-parallel-size", tp) if moe else 1,
        "moe_a2a_overlap": "1f1b" if a.flag("--overlap-moe-expert-parallel-comm") else "none",
        "recompute_modules": fine,
        "sequence_parallel": a.flag("--sequence-parallel"),
        "zero_stage": zero,
        "recompute": recompute,
        "micro_batch_size": mbs,
        # arguments.py: global_batch_size defaults to micro_batch_size x data-parallel size
        "global_batch_size": a.int("--global-batch-size", mbs * dp),
        # a count > 0 turns offloading on (arguments.py:1950 at d98e8a6, which has no
        # --cpu-offloading; older scripts pass both: it is read, and says nothing more)
        "offload_layers": a.int("--cpu-offloading-num-layers", 0) + 0 * a.flag("--cpu-offloading"),
    }
    return out


def _dispatcher(a: Args, notes: list[str]) -> str:
    """--moe-token-dispatcher-type (transformer_config.py: default allgather; flex with
    --moe-flex-dispatcher-backend deepep (default) | hybridep | ncclep) → aihpc's dispatcher."""
    kind = a.get("--moe-token-dispatcher-type", "allgather")
    backend = a.get("--moe-flex-dispatcher-backend", "deepep")
    if kind == "flex":
        if backend not in ("deepep", "hybridep"):
            raise SpecError(
                "--moe-flex-dispatcher-backend", backend, "aihpc prices deepep | hybridep"
            )
        return "hierarchical"
    if kind == "allgather":
        notes.append(
            "--moe-token-dispatcher-type allgather (Megatron's default): training.moe_stack "
            '"megatron-allgather"'
        )
    elif kind != "alltoall":
        raise SpecError("--moe-token-dispatcher-type", kind, "allowed: allgather | alltoall | flex")
    return "alltoall"


def _moe_stack(a: Args) -> str:
    """training.moe_stack from the dispatcher flags _dispatcher has checked: alltoall and
    allgather as named; flex (or the older --moe-enable-deepep) with DeepEP or HybridEP."""
    kind = a.get("--moe-token-dispatcher-type", "allgather")
    if a.flag("--moe-enable-deepep") or kind == "flex":
        return f"megatron-{a.get('--moe-flex-dispatcher-backend', 'deepep')}"
    return f"megatron-{kind}"


def _expert_gemm(a: Args) -> str:
    """How Megatron-LM runs the local experts' GEMMs (arguments.py; perf/step/moe_kernels.py):
    without --moe-grouped-gemm a SequentialMLP (one MLP per expert) and with it TEGroupedMLP
    (Transformer Engine's GroupedLinear, one cuBLAS GEMM per expert on its default path) are
    both one launch per expert; --moe-use-legacy-grouped-gemm selects GroupedMLP, one grouped
    GEMM kernel per projection (the grouped_gemm library's CUTLASS kernels)."""
    grouped, legacy = a.flag("--moe-grouped-gemm"), a.flag("--moe-use-legacy-grouped-gemm")
    return "grouped" if grouped and legacy else "per_expert"


def _cuda_graphs(a: Args) -> str:
    """What Megatron-LM captures in CUDA graphs, at d98e8a6 (TransformerConfig.cuda_graph_impl,
    arguments.py validate_args and core/transformer/cuda_graph_config.py): --cuda-graph-impl
    none (the default: eager) | local | transformer_engine | full_iteration; the deprecated
    --enable-cuda-graph sets local and --external-cuda-graph transformer_engine. local and
    transformer_engine graph each layer (--cuda-graph-modules attn mlp moe moe_router
    moe_preprocess mamba, empty or the deprecated "full" = the whole layer; --cuda-graph-scope is
    its hidden deprecated alias): partial. full_iteration (or the deprecated module value
    full_iteration, which validate_args migrates to that impl) graphs the whole iteration: full.
    Older launches (e.g. 23265d2) spell it --cuda-graph-impl local --cuda-graph-scope
    full_iteration; the same reading covers them."""
    impl = a.get("--cuda-graph-impl", "none")
    if a.flag("--enable-cuda-graph"):
        impl = "local"
    if a.flag("--external-cuda-graph"):
        impl = "transformer_engine"
    a.flag("--no-check-for-nan-in-loss-and-grad")  # full_iteration asserts it is set
    modules: list[str] = []
    for name in ("--cuda-graph-modules", "--cuda-graph-scope"):
        value = a.get(name)
        if value is not None and value is not True:
            modules += value if isinstance(value, list) else str(value).replace(",", " ").split()
    if impl == "full_iteration" or "full_iteration" in modules:
        return "full"
    if impl in ("local", "transformer_engine"):
        return "partial"
    if impl != "none":
        allowed = "none | local | transformer_engine | full_iteration"
        raise SpecError("--cuda-graph-impl", impl, f"allowed: {allowed}")
    return "none"


def _precision(a: Args) -> str:
    if a.get("--fp8-format") is not None or a.get("--fp8") is not None:
        return "fp8"
    if a.flag("--bf16"):
        return "bf16"
    if a.flag("--fp16"):
        return "fp16"
    raise SpecError(
        "--bf16",
        None,
        "Megatron-LM trains in fp32 without --bf16 / --fp16 / --fp8-format; "
        "aihpc prices bf16, fp16, fp8",
    )


def _schedule(a: Args, gbs: int, notes: list[str]) -> tuple[float, int | None, int]:
    """(learning rate, optimizer steps, warm-up steps) with Megatron-LM's defaults."""
    lr = a.float("--lr")
    if lr is None:
        notes.append("--lr not set (Megatron-LM requires it to train): aihpc's 3e-4 kept")
        lr = 3e-4
    train_steps = a.int("--train-iters")
    samples = a.int("--train-samples")
    if train_steps is None and samples:
        train_steps = samples // gbs
    warmup = a.int("--lr-warmup-iters", 0)
    fraction = a.float("--lr-warmup-fraction")
    if fraction is not None:
        warmup = round(fraction * (a.int("--lr-decay-iters") or train_steps or 0))
    if a.flags.get("--lr-decay-style") == "cosine":  # what aihpc's trainer runs
        a.get("--lr-decay-style")
    return lr, train_steps, warmup


def _attention_kernel(a: Args) -> str:
    """The attention kernel class: TE's fused attention, local with flash-attn (FA2), or the
    unfused local path."""
    impl = a.get("--transformer-impl", "transformer_engine")
    backend = a.get("--attention-backend")
    if backend == "unfused" or (impl == "local" and not a.flag("--use-flash-attn")):
        return "unfused"
    return "flash2" if impl == "local" else "flash"


def _state_dtypes(a: Args, precision: str) -> tuple[str, str]:
    """(gradient reduction dtype, optimizer state dtype)."""
    grad_dtype = "fp32"
    if a.flag("--grad-reduce-in-bf16"):
        grad_dtype = "bf16"
    elif precision == "fp16" and not a.flag("--accumulate-allreduce-grads-in-fp32"):
        grad_dtype = "fp16"
    opt_dtype = "fp32"
    if a.flag("--use-precision-aware-optimizer") and a.get("--exp-avg-dtype") in ("bf16", "fp16"):
        opt_dtype = a.get("--exp-avg-dtype")
    a.get("--main-params-dtype")
    return grad_dtype, opt_dtype


def _training(a: Args, precision: str, gbs: int, notes: list[str]) -> dict[str, Any]:
    lr, train_steps, warmup = _schedule(a, gbs, notes)
    optimizer = a.get("--optimizer", "adam")
    if optimizer not in ("adam", "sgd"):
        raise SpecError("--optimizer", optimizer, "allowed: adam | sgd")
    hidden, attn = a.float("--hidden-dropout", 0.1), a.float("--attention-dropout", 0.1)
    if attn != hidden:
        notes.append(f"--attention-dropout {attn} priced as --hidden-dropout {hidden}")
    attention = _attention_kernel(a)
    cp_comm = a.get("--cp-comm-type", "p2p")
    exchange = {"p2p": "ring", "all_gather": "allgather"}.get(str(cp_comm))
    if exchange is None:
        raise SpecError("--cp-comm-type", cp_comm, "aihpc prices p2p | all_gather")
    grad_dtype, opt_dtype = _state_dtypes(a, precision)
    out = {
        "precision": precision,
        # Megatron's adam is decoupled weight decay (FusedAdam, adam_w_mode=True): AdamW
        "optimizer": "adamw" if optimizer == "adam" else "sgd",
        "attention": attention,
        "cross_entropy": "fused" if a.flag("--cross-entropy-loss-fusion") else "vocab_parallel",
        "dropout": hidden,
        "grad_reduce_dtype": grad_dtype,
        "optimizer_dtype": opt_dtype,
        "grad_reduce_overlap": a.flag("--overlap-grad-reduce"),
        "tp_comm_overlap": "userbuffers" if a.flag("--tp-comm-overlap") else "backward",
        "cp_exchange": exchange,
        "fp8_param_gather": a.flag("--fp8-param-gather"),
        "learning_rate": lr,
        "min_lr_ratio": float(f"{a.float('--min-lr', 0.0) / lr:.12g}"),
        "warmup_steps": warmup,
        "weight_decay": a.float("--weight-decay", 0.01),
        "adam_beta1": a.float("--adam-beta1", 0.9),
        "adam_beta2": a.float("--adam-beta2", 0.999),
        "grad_clip": a.float("--clip-grad", 1.0),
        "seed": a.int("--seed", 1234),
        "log_interval": a.int("--log-interval", 100),
        **FIXED,
    }
    if train_steps:
        out["train_steps"] = train_steps
    for name in (
        "--bf16",
        "--fp16",
        "--fp8-format",
        "--fp8",
        "--accumulate-allreduce-grads-in-fp32",
    ):
        a.get(name)
    return out


def import_megatron(
    text: str,
    gpu: str = "h100-sxm",
    num_gpus: int | None = None,
    gpus_per_node: int | None = None,
    vocab_size: int | None = None,
) -> Imported:
    """A pretrain_gpt.py launch script (or a file of its arguments) → run spec."""
    notes: list[str] = []
    emptied: dict[str, str] = {}
    launcher, words = source_words(text, notes, emptied)
    a = Args(parse_flags(words), emptied)
    nodes, per_node = launcher_counts(launcher, emptied)
    gpus_per_node = gpus_per_node or per_node
    if num_gpus is None and nodes and per_node:
        num_gpus = nodes * per_node
    if num_gpus is None:
        raise SpecError(
            "--num-gpus", None, "the source does not say how many GPUs run it: pass --num-gpus N"
        )
    tp = a.int("--tensor-model-parallel-size", 1) or 1
    shape = model_shape(a, tp, notes, vocab_size)
    moe = bool(shape.get("num_experts"))
    parallel = _parallel(a, shape["num_layers"], num_gpus, moe, notes)
    split = _megatron_rules(a, parallel, shape["num_layers"], num_gpus, notes)
    training = _training(a, _precision(a), parallel["global_batch_size"], notes)
    if split:
        training["pipeline_split"] = split
    training["cuda_graphs"] = _cuda_graphs(a)
    if shape.get("num_experts"):
        training["moe_dispatcher"] = _dispatcher(a, notes)
        training["moe_stack"] = _moe_stack(a)
        training["moe_expert_gemm"] = _expert_gemm(a)
    else:
        for name in ("--moe-token-dispatcher-type", "--moe-flex-dispatcher-backend"):
            a.get(name)
        for name in ("--moe-grouped-gemm", "--moe-use-legacy-grouped-gemm", "--moe-enable-deepep"):
            a.flag(name)  # Megatron reads them only with --num-experts
    tables: dict[str, dict[str, Any]] = {
        "model": model_table(shape),
        "cluster": cluster_table(gpu, num_gpus, gpus_per_node),
        "parallel": parallel,
        "training": training,
    }
    save_interval = a.int("--save-interval")
    if save_interval:
        tables["checkpoint"] = {"interval_steps": save_interval}
    unpriced = a.unread()
    return Imported(FRAMEWORK, tables, unpriced, notes)
