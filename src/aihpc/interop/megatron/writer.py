"""Run spec → Megatron-LM: a bash script launching pretrain_gpt.py under torchrun with every
flag the plan sets, or a refusal naming the first field Megatron-LM cannot run.
"""

from __future__ import annotations

import math
import shlex
from typing import Any

from aihpc.interop._common import (
    not_carried,
)
from aihpc.interop._script import comment_text
from aihpc.interop.megatron.flags import FIXED, FRAMEWORK
from aihpc.interop.megatron.shape import freq_pattern
from aihpc.runspec import RunSpec, SpecError

__all__ = ["export_megatron"]


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
    m, c, p = spec.model, spec.cluster, spec.plan()
    _refuse_megatron(spec)
    args = _model_args(m, p.tp)
    args += _parallel_args(p, m.is_moe)
    args += _training_args(spec)
    body = " \\\n    ".join(_flag(k, v) for k, v in args)
    nodes, per_node = c.num_nodes, min(c.gpus_per_node, c.num_gpus)
    header = (
        "#!/bin/bash\n"
        f"# Megatron-LM launch for {comment_text(m.name)} on {c.num_gpus} x "
        f"{comment_text(c.gpu.id)}, written by "
        f"`aihpc export{' ' + comment_text(source) if source else ''} --to megatron`.\n"
        "# Flags as in Megatron-LM's megatron/training/arguments.py (main, Aug 2026). Synthetic\n"
        "# data (--mock-data): point --data-path and the tokenizer at yours.\n"
        "# Run it once per node (srun --ntasks-per-node=1); MASTER_ADDR names the first node.\n"
    )
    launch = (
        f"torchrun --nproc-per-node {int(per_node)} --nnodes {int(nodes)} "
        '--rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR:-localhost}:${MASTER_PORT:-29500}" \\\n'
        "    pretrain_gpt.py \\\n    "
    )
    fixed = {k: v for k, v in FIXED.items() if k != "pipeline_split"}  # even = uneven here
    dropped = not_carried(spec, fixed, FRAMEWORK)
    overlap = spec.training.tp_comm_overlap
    if overlap in ("none", "async_tp") or (overlap == "userbuffers" and not p.sequence_parallel):
        dropped.append(
            f"training.tp_comm_overlap = {overlap!r} ({FRAMEWORK} runs 'backward', or "
            "'userbuffers' with sequence parallelism)"
        )
    return header + launch + body + " \\\n    --mock-data\n", dropped


def _refuse_megatron(spec: RunSpec) -> None:
    """SpecError naming the first field of the plan Megatron-LM cannot run."""
    m, p, t = spec.model, spec.plan(), spec.training
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
    if t.attention not in ("flash", "flash2", "unfused"):
        raise SpecError(
            "training.attention", t.attention, "Megatron-LM runs flash | flash2 | unfused"
        )
    if p.moe_a2a_overlap == "dualpipe":
        raise SpecError(
            "parallel.moe_a2a_overlap",
            "dualpipe",
            "Megatron-LM runs none | 1f1b (--overlap-moe-expert-parallel-comm)",
        )
    if t.moe_dispatch_dtype != "bf16" and m.is_moe:
        raise SpecError(
            "training.moe_dispatch_dtype",
            t.moe_dispatch_dtype,
            "Megatron-LM dispatches bf16 (its only 8-bit wire type is mxfp8, on the ncclep flex "
            "backend)",
        )
    if p.dp_shard is not None and p.dp_shard != p.dp:
        raise SpecError("parallel.dp_shard", p.dp_shard, f"Megatron-LM shards over all dp {p.dp}")
    if t.optimizer == "adam":
        raise SpecError("training.optimizer", "adam", "Megatron-LM runs adamw (its adam) | sgd")
    if t.optimizer_dtype != "fp32" and t.optimizer_dtype != "bf16":
        raise SpecError("training.optimizer_dtype", t.optimizer_dtype, "Megatron-LM: fp32 | bf16")


def _model_args(m: Any, tp: int) -> list[tuple[str, Any]]:
    """The model's pretrain_gpt.py flags: shape, attention, MoE, MLA, MTP, tokenizer."""
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
        ("--make-vocab-size-divisible-by", _vocab_divisor(m.vocab_size, tp)),
    ]
    if m.is_moe:
        args += [("--num-experts", m.num_experts), ("--moe-router-topk", m.moe_top_k)]
        args.append(("--moe-ffn-hidden-size", m.expert_ffn_hidden_size))
        if m.num_shared_experts:
            size = m.num_shared_experts * m.expert_ffn_hidden_size
            args.append(("--moe-shared-expert-intermediate-size", size))
        freq = freq_pattern(m.num_layers, m.first_dense_layers, m.moe_layer_freq)
        if freq is not None:
            args.append(("--moe-layer-freq", freq))
        args += _router_args(m)
    if m.is_mla:
        args.append(("--multi-latent-attention", None))
        if m.q_lora_rank is not None:
            args.append(("--q-lora-rank", m.q_lora_rank))
        args += [
            ("--kv-lora-rank", m.kv_lora_rank),
            ("--qk-head-dim", m.qk_nope_head_dim),
            ("--qk-pos-emb-head-dim", m.qk_rope_head_dim),
            ("--v-head-dim", m.v_head_dim),
        ]
    if m.attention_window is not None:
        args.append(("--window-size", f"{m.attention_window - 1},0"))
        if m.full_attention_every:
            args.append(("--window-attn-skip-freq", m.full_attention_every))
    if m.mtp_layers:
        args.append(("--mtp-num-layers", m.mtp_layers))
    return args


def _router_args(m: Any) -> list[tuple[str, Any]]:
    """The MoE router flags whose value differs from Megatron-LM's default."""
    args: list[tuple[str, Any]] = []
    if m.moe_capacity_factor is not None:
        args.append(("--moe-expert-capacity-factor", m.moe_capacity_factor))
    if m.moe_router_groups:
        args += [
            ("--moe-router-num-groups", m.moe_router_groups),
            ("--moe-router-group-topk", m.moe_router_group_topk),
        ]
    if m.moe_router_score_function != "softmax":
        args.append(("--moe-router-score-function", m.moe_router_score_function))
    if m.moe_router_topk_scaling_factor != 1.0:
        args.append(("--moe-router-topk-scaling-factor", m.moe_router_topk_scaling_factor))
    if m.moe_router_bias_update_rate:
        args.append(("--moe-router-enable-expert-bias", None))
        args.append(("--moe-router-bias-update-rate", m.moe_router_bias_update_rate))
    if m.moe_aux_loss_coeff:
        # aihpc's balance loss is sequence-wise (DeepSeek-V3's): Megatron's seq_aux_loss
        args.append(("--moe-router-load-balancing-type", "seq_aux_loss"))
        args.append(("--moe-aux-loss-coeff", m.moe_aux_loss_coeff))
    return args


def _parallel_args(p: Any, moe: bool = False) -> list[tuple[str, Any]]:
    args: list[tuple[str, Any]] = [
        ("--tensor-model-parallel-size", p.tp),
        ("--pipeline-model-parallel-size", p.pp),
        ("--context-parallel-size", p.cp),
    ]
    if p.vpp > 1:
        args.append(("--num-virtual-stages-per-pipeline-rank", p.vpp))
    if p.ep > 1:
        args.append(("--expert-model-parallel-size", p.ep))
    if moe:  # Megatron-LM defaults expert_tensor_parallel_size to tp (arguments.py)
        args.append(("--expert-tensor-parallel-size", p.etp))
    if p.moe_a2a_overlap == "1f1b":
        args.append(("--overlap-moe-expert-parallel-comm", None))
    if p.sequence_parallel:
        args.append(("--sequence-parallel", None))
    if p.zero_stage == 1:
        args.append(("--use-distributed-optimizer", None))
    elif p.zero_stage == 3:
        args.append(("--use-torch-fsdp2", None))
    if p.recompute in ("selective", "full"):
        args.append(("--recompute-granularity", p.recompute))
    elif p.recompute_modules:  # fine-grained recompute without core attention's
        args.append(("--recompute-granularity", "selective"))
    if p.recompute_modules:  # Megatron's default list is ["core_attn"]: selective alone
        core = ["core_attn"] if p.recompute == "selective" else []
        args.append(("--recompute-modules", [*core, *p.recompute_modules]))
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
    if t.tp_comm_overlap == "userbuffers" and spec.plan().sequence_parallel:
        args.append(("--tp-comm-overlap", None))  # Megatron asserts it needs SP
    if t.cp_exchange == "allgather":
        args.append(("--cp-comm-type", "all_gather"))
    if spec.model.is_moe and t.moe_dispatcher == "hierarchical":
        args += [("--moe-token-dispatcher-type", "flex")]
        args += [("--moe-flex-dispatcher-backend", "deepep")]
    elif spec.model.is_moe:
        args.append(("--moe-token-dispatcher-type", "alltoall"))
    if spec.model.is_moe:  # per_expert: TEGroupedMLP; grouped: GroupedMLP (_expert_gemm)
        args.append(("--moe-grouped-gemm", None))
        if t.moe_expert_gemm == "grouped":
            args.append(("--moe-use-legacy-grouped-gemm", None))
    if t.cuda_graphs == "full":  # _cuda_graphs; validate_args asserts the NaN check is off
        args += [("--cuda-graph-impl", "full_iteration")]
        args.append(("--no-check-for-nan-in-loss-and-grad", None))
    elif t.cuda_graphs == "partial":  # per-layer TE graphs of the attention alone
        args += [("--cuda-graph-impl", "transformer_engine"), ("--cuda-graph-modules", "attn")]
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
    if isinstance(value, list):
        return " ".join([name, *(shlex.quote(str(v)) for v in value)])
    return name if value is None else f"{name} {shlex.quote(str(value))}"
