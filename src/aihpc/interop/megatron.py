"""Megatron-LM ``pretrain_gpt.py`` arguments ⇄ run spec.

Flag names and defaults are Megatron-LM's at commit d98e8a6 (main, Aug 2026, after
core_v0.15.0): ``megatron/training/arguments.py`` and the dataclass defaults it exposes from
``megatron/core/transformer/transformer_config.py`` and ``model_parallel_config.py``
(hidden_dropout = attention_dropout = 0.1, moe_router_topk = 2, weight_decay 0.01, adam_beta2
0.999, clip_grad 1.0, min_lr 0, make_vocab_size_divisible_by 128, position embeddings
learned_absolute, no sequence parallel, no recompute, no distributed optimizer). The
training-loop defaults read here (seed 1234, log_interval 100) are those of arguments.py since
Megatron-LM v2 and unchanged through core_r0.12.0.
"""

from __future__ import annotations

import math
import re
import shlex
from typing import Any

from aihpc.interop._common import (
    Imported,
    as_float,
    as_int,
    cluster_table,
    model_table,
    not_carried,
    require,
)
from aihpc.interop.shell import command_tokens, expand_script
from aihpc.spec import RunSpec, SpecError

__all__ = ["FIXED", "export_megatron", "import_megatron", "parse_flags"]

FRAMEWORK = "Megatron-LM"
# [training] fields Megatron-LM does not let a launch choose: what it runs.
FIXED: dict[str, Any] = {
    "pipeline_split": "even",  # arguments.py asserts num_layers % (pp [* vpp]) == 0
    "fp8_saved_inputs": "fp8",  # Transformer Engine keeps the FP8 cast for the backward
    "kv_repeat": False,
    "fused_kernels": True,  # bias-gelu / bias-dropout / softmax fusions are on by default
    "zero3_gather": "bucketed",
}
# torchrun's own options (launcher side) that say where the job runs, not what it trains.
_LAUNCHER_VALUE = {
    "--nproc_per_node",
    "--nproc-per-node",
    "--nnodes",
    "--node_rank",
    "--node-rank",
    "--master_addr",
    "--master-addr",
    "--master_port",
    "--master-port",
    "--rdzv_backend",
    "--rdzv-backend",
    "--rdzv_endpoint",
    "--rdzv-endpoint",
    "--rdzv_id",
    "--rdzv-id",
    "--max_restarts",
    "--max-restarts",
    "--log-dir",
    "--log_dir",
    "--redirects",
    "--tee",
    "--rdzv-conf",
    "--rdzv_conf",
    "--local-ranks-filter",
    "--local_ranks_filter",
}
# Llama 3's tokenizer has 128,256 entries (Meta Llama 3 model card; tokenizer.json).
_KNOWN_TOKENIZERS = {"llama-3": 128256, "llama3": 128256}


def parse_flags(words: list[str]) -> dict[str, Any]:
    """``--flag value...`` words → {"--flag": "value" | [values] | True}, in order; ``_`` in a
    flag's name reads as ``-`` (argparse accepts both spellings only for some; we read both)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(words):
        w = words[i]
        if not w.startswith("--"):
            i += 1
            continue
        name, eq, value = w.partition("=")
        name = "--" + name[2:].replace("_", "-")
        if eq:
            out[name] = value
            i += 1
            continue
        values = []
        i += 1
        while i < len(words) and not (words[i].startswith("--") and len(words[i]) > 2):
            values.append(words[i])
            i += 1
        out[name] = True if not values else values[0] if len(values) == 1 else values
    return out


class _Args:
    """The flags, with a record of which ones the import read."""

    def __init__(self, flags: dict[str, Any]) -> None:
        self.flags = flags
        self.read: set[str] = set()

    def get(self, name: str, default: Any = None) -> Any:
        self.read.add(name)
        return self.flags.get(name, default)

    def flag(self, name: str) -> bool:
        return self.get(name) is not None and self.get(name) is not False

    def int(self, name: str, default: int | None = None) -> int | None:
        v = self.get(name)
        return default if v is None else as_int(v, name)

    def float(self, name: str, default: float | None = None) -> float | None:
        v = self.get(name)
        return default if v is None else as_float(v, name)

    def unread(self) -> list[str]:
        return [f for f in self.flags if f not in self.read]


def _source_words(text: str) -> tuple[list[str], list[str]]:
    """(launcher words, Megatron arguments) of a launch script, or ([], words) of a file of
    arguments."""
    found = command_tokens(text, "pretrain_gpt.py")
    if found is not None:
        return found
    words = [w for cmd in expand_script(text) for w in cmd]
    if not any(w.startswith("--") for w in words):
        raise SpecError(
            "SOURCE", text[:40], "expected a script running pretrain_gpt.py or its --arguments"
        )
    return [], words


def _launcher(words: list[str]) -> tuple[int | None, int | None]:
    """(nodes, processes per node) from torchrun's / python -m torch.distributed.run's words."""
    flags = parse_flags(words)
    nproc = flags.get("--nproc-per-node")
    nnodes = flags.get("--nnodes")
    nodes = as_int(str(nnodes).split(":")[-1], "--nnodes") if nnodes else None
    per_node = as_int(nproc, "--nproc-per-node") if nproc and str(nproc).isdigit() else None
    return nodes, per_node


def _model(a: _Args, tp: int, notes: list[str], vocab_size: int | None) -> dict[str, Any]:
    h = require(a.int("--hidden-size"), "--hidden-size", "required by Megatron-LM")
    heads = require(a.int("--num-attention-heads"), "--num-attention-heads", "required")
    swiglu, relu2 = a.flag("--swiglu"), a.flag("--squared-relu")
    # arguments.py: ffn_hidden_size defaults to 4h, or int(4h * 2/3 / 64) * 64 with --swiglu
    ffn = a.int("--ffn-hidden-size") or (int(4 * h * 2 / 3 / 64) * 64 if swiglu else 4 * h)
    shape: dict[str, Any] = {
        "num_layers": require(a.int("--num-layers"), "--num-layers", "required"),
        "hidden_size": h,
        "num_attention_heads": heads,
        "ffn_hidden_size": ffn,
        "ffn_activation": "swiglu" if swiglu else "relu2" if relu2 else "gelu",
        "seq_length": require(a.int("--seq-length"), "--seq-length", "required"),
        "tied_embeddings": not a.flag("--untie-embeddings-and-output-weights"),
        "vocab_size": _vocab(a, tp, notes, vocab_size),
    }
    a.get("--max-position-embeddings")  # positions table size; the sequence length is priced
    if a.flag("--group-query-attention"):
        shape["num_kv_heads"] = a.int("--num-query-groups", 1)
    else:
        a.get("--num-query-groups")  # read, and ignored without GQA (as Megatron does)
    pos = a.get("--position-embedding-type", "learned_absolute")
    if a.flag("--use-rotary-position-embeddings"):
        pos = "rope"
    if pos not in ("rope", "learned_absolute"):
        raise SpecError("--position-embedding-type", pos, "aihpc prices rope | learned_absolute")
    shape["position_embedding"] = "rope" if pos == "rope" else "learned"
    kv = a.int("--kv-channels")
    if kv is not None and kv * heads != h:
        shape["head_dim"] = kv
    experts = a.int("--num-experts") or 0
    if experts:
        moe_ffn = a.int("--moe-ffn-hidden-size", ffn)
        shape.update(num_experts=experts, moe_top_k=a.int("--moe-router-topk", 2))
        if moe_ffn != ffn:
            shape["moe_ffn_hidden_size"] = moe_ffn
        shared = a.int("--moe-shared-expert-intermediate-size") or 0
        if shared % moe_ffn:
            raise SpecError(
                "--moe-shared-expert-intermediate-size",
                shared,
                f"a multiple of the expert FFN size {moe_ffn} (aihpc counts whole shared experts)",
            )
        shape["num_shared_experts"] = shared // moe_ffn
        shape["first_dense_layers"] = _first_dense(a.get("--moe-layer-freq", "1"))
    return shape


def _first_dense(freq: str) -> int:
    """``--moe-layer-freq``: 1 (every layer MoE) or ``([0]*k+[1]*m)`` (k dense layers first)."""
    text = str(freq).replace(" ", "")
    if text == "1":
        return 0
    m = re.fullmatch(r"\(?\[0\]\*(\d+)\+\[1\]\*(\d+)\)?", text)
    if not m:
        raise SpecError("--moe-layer-freq", freq, "aihpc prices 1 or ([0]*K+[1]*M)")
    return int(m.group(1))


def _vocab(a: _Args, tp: int, notes: list[str], given: int | None) -> int:
    """The vocabulary Megatron builds: the tokenizer's, padded up to a multiple of
    make_vocab_size_divisible_by x tp (arguments.py / tokenizer _vocab_size_with_padding)."""
    size = a.int("--vocab-size") or given
    model = str(a.get("--tokenizer-model") or "").lower()
    a.get("--tokenizer-type")
    if size is None:
        size = next((v for k, v in _KNOWN_TOKENIZERS.items() if k in model), None)
        if size is not None:
            notes.append(f"vocab_size {size}: the Llama 3 tokenizer named by --tokenizer-model")
    if size is None:
        raise SpecError(
            "--vocab-size", None, "the source names no vocabulary size: pass --vocab-size N"
        )
    multiple = a.int("--make-vocab-size-divisible-by", 128) * tp
    padded = -(-size // multiple) * multiple
    if padded != size:
        notes.append(f"vocab_size {size} padded to {padded} (multiple of {multiple}, as Megatron)")
    return padded


def _parallel(a: _Args, num_layers: int, world: int) -> dict[str, Any]:
    tp = a.int("--tensor-model-parallel-size", 1)
    pp = a.int("--pipeline-model-parallel-size", 1)
    cp = a.int("--context-parallel-size", 1)
    mbs = require(a.int("--micro-batch-size"), "--micro-batch-size", "required by Megatron-LM")
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
    zero = 3 if a.flag("--use-torch-fsdp2") else 1 if a.flag("--use-distributed-optimizer") else 0
    granularity = a.get("--recompute-granularity")
    recompute = {None: "none", "selective": "selective", "full": "full"}.get(granularity)
    if recompute is None:
        raise SpecError("--recompute-granularity", granularity, "allowed: selective | full")
    out = {
        "tp": tp,
        "pp": pp,
        "vpp": vpp or 1,
        "cp": cp,
        "dp": dp,
        "ep": a.int("--expert-model-parallel-size", 1),
        "sequence_parallel": a.flag("--sequence-parallel"),
        "zero_stage": zero,
        "recompute": recompute,
        "micro_batch_size": mbs,
        # arguments.py: global_batch_size defaults to micro_batch_size x data-parallel size
        "global_batch_size": a.int("--global-batch-size", mbs * dp),
        "offload_layers": a.int("--cpu-offloading-num-layers", 0)
        if a.flag("--cpu-offloading")
        else 0,
    }
    return out


def _precision(a: _Args) -> str:
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


def _training(a: _Args, precision: str, gbs: int, notes: list[str]) -> dict[str, Any]:
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
    optimizer = a.get("--optimizer", "adam")
    if optimizer not in ("adam", "sgd"):
        raise SpecError("--optimizer", optimizer, "allowed: adam | sgd")
    hidden, attn = a.float("--hidden-dropout", 0.1), a.float("--attention-dropout", 0.1)
    if attn != hidden:
        notes.append(f"--attention-dropout {attn} priced as --hidden-dropout {hidden}")
    impl = a.get("--transformer-impl", "transformer_engine")
    backend = a.get("--attention-backend")
    if backend == "unfused" or (impl == "local" and not a.flag("--use-flash-attn")):
        attention = "unfused"
    elif impl == "local":
        attention = "flash2"
    else:
        attention = "flash"
    cp_comm = a.get("--cp-comm-type", "p2p")
    exchange = {"p2p": "ring", "all_gather": "allgather"}.get(cp_comm)
    if exchange is None:
        raise SpecError("--cp-comm-type", cp_comm, "aihpc prices p2p | all_gather")
    grad_dtype = "fp32"
    if a.flag("--grad-reduce-in-bf16"):
        grad_dtype = "bf16"
    elif precision == "fp16" and not a.flag("--accumulate-allreduce-grads-in-fp32"):
        grad_dtype = "fp16"
    opt_dtype = "fp32"
    if a.flag("--use-precision-aware-optimizer") and a.get("--exp-avg-dtype") in ("bf16", "fp16"):
        opt_dtype = a.get("--exp-avg-dtype")
    a.get("--main-params-dtype")
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
    launcher, words = _source_words(text)
    a = _Args(parse_flags(words))
    notes: list[str] = []
    nodes, per_node = _launcher(launcher)
    gpus_per_node = gpus_per_node or per_node
    if num_gpus is None and nodes and per_node:
        num_gpus = nodes * per_node
    if num_gpus is None:
        raise SpecError(
            "--num-gpus", None, "the source does not say how many GPUs run it: pass --num-gpus N"
        )
    tp = a.int("--tensor-model-parallel-size", 1) or 1
    shape = _model(a, tp, notes, vocab_size)
    parallel = _parallel(a, shape["num_layers"], num_gpus)
    training = _training(a, _precision(a), parallel["global_batch_size"], notes)
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


def _vocab_divisor(vocab: int, tp: int) -> int:
    """The largest make_vocab_size_divisible_by ≤ 128 that leaves ``vocab`` unpadded at ``tp``."""
    if vocab % tp:
        raise SpecError(
            "model.vocab_size",
            vocab,
            f"Megatron-LM pads the vocabulary to a multiple of tp {tp}: use a padded size",
        )
    return math.gcd(vocab // tp, 128)


def export_megatron(spec: RunSpec, source: str = "") -> tuple[str, list[str]]:
    """(a bash script launching pretrain_gpt.py under torchrun, run-spec fields it cannot
    carry); a plan Megatron-LM cannot run raises SpecError naming the field."""
    m, c, p, t = spec.model, spec.cluster, spec.plan(), spec.training
    chunks = p.pp * p.vpp
    if m.num_layers % chunks:
        raise SpecError(
            "parallel.pp",
            p.pp,
            f"Megatron-LM splits layers evenly: pp x vpp = {chunks} must divide num_layers "
            f"{m.num_layers}",
        )
    if p.schedule == "zbv":
        raise SpecError("parallel.pp_schedule", "zbv", "Megatron-LM runs 1f1b | interleaved-1f1b")
    if p.zero_stage == 2:
        raise SpecError(
            "parallel.zero_stage", 2, "Megatron-LM runs 0 | 1 (distributed optimizer) | 3 (FSDP2)"
        )
    if p.recompute == "op":
        raise SpecError("parallel.recompute", "op", "Megatron-LM runs none | selective | full")
    if p.dp_shard is not None and p.dp_shard != p.dp:
        raise SpecError("parallel.dp_shard", p.dp_shard, f"Megatron-LM shards over all dp {p.dp}")
    if t.optimizer == "adam":
        raise SpecError("training.optimizer", "adam", "Megatron-LM runs adamw (its adam) | sgd")
    if t.optimizer_dtype != "fp32" and t.optimizer_dtype != "bf16":
        raise SpecError("training.optimizer_dtype", t.optimizer_dtype, "Megatron-LM: fp32 | bf16")
    args: list[tuple[str, Any]] = [
        ("--num-layers", m.num_layers),
        ("--hidden-size", m.hidden_size),
        ("--ffn-hidden-size", m.ffn_hidden_size),
        ("--num-attention-heads", m.num_attention_heads),
    ]
    if m.num_kv_heads is not None:
        args += [("--group-query-attention", None), ("--num-query-groups", m.num_kv_heads)]
    if m.head_dim is not None:
        args.append(("--kv-channels", m.head_dim))
    args += [("--seq-length", m.seq_length), ("--max-position-embeddings", m.seq_length)]
    args += [("--swiglu", None)] if m.ffn_activation == "swiglu" else []
    args += [("--squared-relu", None)] if m.ffn_activation == "relu2" else []
    pos = "rope" if m.position_embedding == "rope" else "learned_absolute"
    args.append(("--position-embedding-type", pos))
    if not m.tied_embeddings:
        args.append(("--untie-embeddings-and-output-weights", None))
    args += [("--normalization", "RMSNorm"), ("--disable-bias-linear", None)]
    args += [
        ("--tokenizer-type", "NullTokenizer"),
        ("--vocab-size", m.vocab_size),
        ("--make-vocab-size-divisible-by", _vocab_divisor(m.vocab_size, p.tp)),
    ]
    if m.is_moe:
        args += [("--num-experts", m.num_experts), ("--moe-router-topk", m.moe_top_k)]
        args.append(("--moe-ffn-hidden-size", m.expert_ffn_hidden_size))
        if m.num_shared_experts:
            size = m.num_shared_experts * m.expert_ffn_hidden_size
            args.append(("--moe-shared-expert-intermediate-size", size))
        if m.first_dense_layers:
            freq = f"([0]*{m.first_dense_layers}+[1]*{m.num_layers - m.first_dense_layers})"
            args.append(("--moe-layer-freq", freq))
    args += _parallel_args(p)
    args += _training_args(spec)
    body = " \\\n    ".join(_flag(k, v) for k, v in args)
    nodes, per_node = c.num_nodes, min(c.gpus_per_node, c.num_gpus)
    header = (
        "#!/bin/bash\n"
        f"# Megatron-LM launch for {m.name} on {c.num_gpus} x {c.gpu.id}, written by "
        f"`aihpc export{' ' + source if source else ''} --to megatron`.\n"
        "# Flags as in Megatron-LM's megatron/training/arguments.py (main, Aug 2026). Synthetic\n"
        "# data (--mock-data): point --data-path and the tokenizer at yours.\n"
        "# Run it once per node (srun --ntasks-per-node=1); MASTER_ADDR names the first node.\n"
    )
    launch = (
        f"torchrun --nproc-per-node {per_node} --nnodes {nodes} "
        '--rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR:-localhost}:${MASTER_PORT:-29500}" \\\n'
        "    pretrain_gpt.py \\\n    "
    )
    fixed = {k: v for k, v in FIXED.items() if k != "pipeline_split"}  # even = uneven here
    return header + launch + body + " \\\n    --mock-data\n", not_carried(spec, fixed, FRAMEWORK)


def _parallel_args(p: Any) -> list[tuple[str, Any]]:
    args: list[tuple[str, Any]] = [
        ("--tensor-model-parallel-size", p.tp),
        ("--pipeline-model-parallel-size", p.pp),
        ("--context-parallel-size", p.cp),
    ]
    if p.vpp > 1:
        args.append(("--num-virtual-stages-per-pipeline-rank", p.vpp))
    if p.ep > 1:
        args.append(("--expert-model-parallel-size", p.ep))
    if p.sequence_parallel:
        args.append(("--sequence-parallel", None))
    if p.zero_stage == 1:
        args.append(("--use-distributed-optimizer", None))
    elif p.zero_stage == 3:
        args.append(("--use-torch-fsdp2", None))
    if p.recompute in ("selective", "full"):
        args.append(("--recompute-granularity", p.recompute))
    if p.recompute == "full":
        args += [("--recompute-method", "uniform"), ("--recompute-num-layers", 1)]
    if p.offload_layers:
        args += [("--cpu-offloading", None), ("--cpu-offloading-num-layers", p.offload_layers)]
    args += [
        ("--micro-batch-size", p.micro_batch_size),
        ("--global-batch-size", p.global_batch_size),
    ]
    return args


def _training_args(spec: RunSpec) -> list[tuple[str, Any]]:
    t, ck = spec.training, spec.checkpoint
    args: list[tuple[str, Any]] = []
    if t.precision == "fp8":
        args += [("--bf16", None), ("--fp8-format", "hybrid")]
    else:
        args.append((f"--{t.precision}", None))
    if t.grad_reduce_dtype == "fp32" and t.precision == "fp16":
        args.append(("--accumulate-allreduce-grads-in-fp32", None))
    if t.grad_reduce_dtype == "bf16":
        args.append(("--grad-reduce-in-bf16", None))
    if t.optimizer_dtype != "fp32":
        args += [("--use-precision-aware-optimizer", None), ("--exp-avg-dtype", t.optimizer_dtype)]
        args.append(("--exp-avg-sq-dtype", t.optimizer_dtype))
    if t.fp8_param_gather:
        args.append(("--fp8-param-gather", None))
    if t.attention == "unfused":
        args += [("--transformer-impl", "local")]
    elif t.attention == "flash2":
        args += [("--transformer-impl", "local"), ("--use-flash-attn", None)]
    if t.cross_entropy == "fused":
        args.append(("--cross-entropy-loss-fusion", None))
    if t.grad_reduce_overlap:
        args.append(("--overlap-grad-reduce", None))
    if t.cp_exchange == "allgather":
        args.append(("--cp-comm-type", "all_gather"))
    args += [
        ("--hidden-dropout", t.dropout),
        ("--attention-dropout", t.dropout),
        ("--optimizer", "adam" if t.optimizer == "adamw" else "sgd"),
        ("--lr", t.learning_rate),
        ("--min-lr", t.learning_rate * t.min_lr_ratio),
        ("--lr-decay-style", "cosine"),
        ("--lr-warmup-iters", t.warmup_steps),
        ("--train-iters", t.train_steps),
        ("--weight-decay", t.weight_decay),
        ("--adam-beta1", t.adam_beta1),
        ("--adam-beta2", t.adam_beta2),
        ("--clip-grad", t.grad_clip),
        ("--seed", t.seed),
        ("--log-interval", t.log_interval),
        ("--save-interval", ck.interval_steps),
    ]
    return args


def _flag(name: str, value: Any) -> str:
    return name if value is None else f"{name} {shlex.quote(str(value))}"
