"""Run spec → Megatron-LM: a bash script launching pretrain_gpt.py under torchrun with every
flag the plan sets, or a refusal naming the first field Megatron-LM cannot run.
"""

from __future__ import annotations

import shlex
from dataclasses import replace
from typing import Any

from aihpc.interop._script import comment_text
from aihpc.interop.megatron.flags import FIXED, FRAMEWORK
from aihpc.interop.megatron.runs import (
    cuda_connections,
    megatron_refusal,
    padded_vocab,
    pipeline_layout,
    vocab_divisor,
)
from aihpc.interop.megatron.shape import freq_pattern
from aihpc.runspec import RunSpec, SpecError
from aihpc.runspec.training import MOE_STACK_DISPATCHER, TrainingSpec

__all__ = ["export_megatron", "megatron_as_run"]


def export_megatron(spec: RunSpec, source: str = "") -> tuple[str, list[str]]:
    """(a bash script launching pretrain_gpt.py under torchrun, run-spec fields it cannot
    carry); a plan Megatron-LM cannot run raises SpecError naming the field."""
    m, c, p = spec.model, spec.cluster, spec.plan()
    err = megatron_refusal(m, p, spec.training)
    if err is not None:
        raise err
    args = _model_args(m, p.tp)
    args += _parallel_args(p, m.is_moe, pipeline_layout(m, p, spec.training.pipeline_split))
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
        + _environment(p)
    )
    launch = (
        f"torchrun --nproc-per-node {int(per_node)} --nnodes {int(nodes)} "
        '--rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR:-localhost}:${MASTER_PORT:-29500}" \\\n'
        "    pretrain_gpt.py \\\n    "
    )
    dropped = [f"{name} = {mine!r} ({FRAMEWORK} runs {theirs!r})" for name, mine, theirs in
               _changes(spec)]  # fmt: skip
    return header + launch + body + " \\\n    --mock-data\n", dropped


def megatron_as_run(spec: RunSpec) -> tuple[RunSpec, list[str]]:
    """(the run spec as Megatron-LM runs the exported script, the fields it changed, each
    "field = ours -> theirs"); the spec itself where nothing changed."""
    changes = _changes(spec)
    training = {n.split(".", 1)[1]: v for n, _, v in changes if n.startswith("training.")}
    model = {n.split(".", 1)[1]: v for n, _, v in changes if n.startswith("model.")}
    if not changes:
        return spec, []
    if model and not spec.model.name.endswith("(modified)"):  # as an edited preset is named
        model["name"] = f"{spec.model.name} (modified)"
    ran = replace(
        spec,
        model=replace(spec.model, **model),
        training=replace(spec.training, **training),
    )
    return ran, [f"{n} = {mine!r} -> {theirs!r}" for n, mine, theirs in changes]


def megatron_stack(t: TrainingSpec) -> str:
    """The Megatron-Core dispatcher that runs the spec's MoE layers (training.moe_stack): its
    own where it names one, else by the dispatcher (hierarchical: DeepEP, or HybridEP under a
    whole-iteration CUDA graph, which DeepEP's host wait rules out)."""
    if t.moe_stack.startswith("megatron-"):
        return t.moe_stack
    if MOE_STACK_DISPATCHER.get(t.moe_stack, t.moe_dispatcher) == "hierarchical":
        return "megatron-hybridep" if t.cuda_graphs == "full" else "megatron-deepep"
    return "megatron-alltoall"


def _changes(spec: RunSpec) -> list[tuple[str, Any, Any]]:
    """(field, the run spec's value, what Megatron-LM runs) for each field it runs otherwise."""
    t, p, m = spec.training, spec.plan(), spec.model
    fixed = {k: v for k, v in FIXED.items() if k != "pipeline_split"}  # written as a layout
    if t.precision != "fp8":
        fixed.pop("fp8_saved_inputs")  # read only by FP8 runs
    out = [(f"training.{k}", getattr(t, k), v) for k, v in fixed.items() if getattr(t, k) != v]
    overlap = t.tp_comm_overlap
    if overlap in ("none", "async_tp") or (overlap == "userbuffers" and not p.sequence_parallel):
        out.append(("training.tp_comm_overlap", overlap, "backward"))
    stack = megatron_stack(t)
    if m.is_moe and t.moe_stack != stack:  # the dispatcher Megatron-LM runs
        out.append(("training.moe_stack", t.moe_stack, stack))
    runs = MOE_STACK_DISPATCHER.get(t.moe_stack, t.moe_dispatcher)  # a named stack's own
    if m.is_moe and runs != MOE_STACK_DISPATCHER[stack]:
        out.append(("training.moe_dispatcher", runs, MOE_STACK_DISPATCHER[stack]))
    if m.is_moe and t.moe_expert_gemm == "grouped":  # d98e8a6 builds TEGroupedMLP only
        out.append(("training.moe_expert_gemm", "grouped", "per_expert"))
    padded = padded_vocab(m.vocab_size, vocab_divisor(m.vocab_size, p.tp), p.tp)
    if padded != m.vocab_size:
        out.append(("model.vocab_size", m.vocab_size, padded))
    return out


def _environment(p: Any) -> str:
    """The environment lines Megatron-LM's validate_args needs for the plan."""
    connections = cuda_connections(p)
    if connections == "1":
        return (
            "# tp or cp > 1: validate_args asserts one CUDA connection (Hopper and before)\n"
            "export CUDA_DEVICE_MAX_CONNECTIONS=1\n"
        )
    if connections == "unset":
        return (
            "# FSDP2: validate_args asserts CUDA_DEVICE_MAX_CONNECTIONS is not 1\n"
            "unset CUDA_DEVICE_MAX_CONNECTIONS\n"
        )
    return ""


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
    if m.position_embedding == "rope":  # arguments.py: --rotary-base, an int, default 10000
        args.append(("--rotary-base", _rotary_base(m.rope_theta)))
    if not m.tied_embeddings:
        args.append(("--untie-embeddings-and-output-weights", None))
    args += [("--normalization", "RMSNorm"), ("--disable-bias-linear", None)]
    args += [
        ("--tokenizer-type", "NullTokenizer"),
        ("--vocab-size", m.vocab_size),
        ("--make-vocab-size-divisible-by", vocab_divisor(m.vocab_size, tp)),
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


def _rotary_base(theta: float) -> int:
    if theta != int(theta):
        raise SpecError("model.rope_theta", theta, "Megatron-LM's --rotary-base is an integer")
    return int(theta)


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


def _parallel_args(p: Any, moe: bool, layout: str | None) -> list[tuple[str, Any]]:
    args: list[tuple[str, Any]] = [
        ("--tensor-model-parallel-size", p.tp),
        ("--pipeline-model-parallel-size", p.pp),
        ("--context-parallel-size", p.cp),
    ]
    if layout is not None:  # its stage count sets vpp (arguments.py:941-950)
        args.append(("--pipeline-model-parallel-layout", layout))
    elif p.vpp > 1:
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
    elif p.zero_stage == 3:  # validate_args refuses FSDP2 with the fusion (arguments.py:1040)
        args += [("--use-torch-fsdp2", None), ("--no-gradient-accumulation-fusion", None)]
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
        # d98e8a6 has no --cpu-offloading: a layer count > 0 turns it on (arguments.py:1950)
        args.append(("--cpu-offloading-num-layers", p.offload_layers))
    args += [
        ("--micro-batch-size", p.micro_batch_size),
        ("--global-batch-size", p.global_batch_size),
    ]
    return args


def _training_args(spec: RunSpec) -> list[tuple[str, Any]]:
    t, ck = spec.training, spec.checkpoint
    args: list[tuple[str, Any]] = []
    if t.precision == "fp8":  # TransformerConfig.fp8 / fp8_recipe (its default, delayed)
        args += [("--bf16", None), ("--fp8-format", "hybrid"), ("--fp8-recipe", "delayed")]
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
    stack = megatron_stack(t)
    if spec.model.is_moe and stack in ("megatron-deepep", "megatron-hybridep"):
        args += [("--moe-token-dispatcher-type", "flex")]
        args += [("--moe-flex-dispatcher-backend", stack.removeprefix("megatron-"))]
    elif spec.model.is_moe:
        args.append(("--moe-token-dispatcher-type", stack.removeprefix("megatron-")))
    if spec.model.is_moe:  # TEGroupedMLP: d98e8a6 has no legacy GroupedMLP flag any more
        args.append(("--moe-grouped-gemm", None))
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
        ("--min-lr", f"{t.learning_rate * t.min_lr_ratio:.12g}"),  # 3e-05, not 2.99...e-05
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
