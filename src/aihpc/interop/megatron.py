"""Megatron-LM ``pretrain_gpt.py`` arguments ⇄ run spec.

Flag names and defaults are Megatron-LM's at commit d98e8a6 (main, Aug 2026, after
core_v0.15.0): ``megatron/training/arguments.py`` and the dataclass defaults it exposes from
``megatron/core/transformer/transformer_config.py`` and ``model_parallel_config.py``
(hidden_dropout = attention_dropout = 0.1, moe_router_topk = 2, moe_token_dispatcher_type
allgather, expert_tensor_parallel_size = tp, recompute_modules ["core_attn"], weight_decay
0.01, adam_beta2 0.999, clip_grad 1.0, min_lr 0, make_vocab_size_divisible_by 128, position
embeddings learned_absolute, no sequence parallel, no recompute, no distributed optimizer). The
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
from aihpc.spec.parallel import RECOMPUTE_MODULES

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
        first, freq = _layer_freq(a.get("--moe-layer-freq", "1"), shape["num_layers"])
        shape["first_dense_layers"], shape["moe_layer_freq"] = first, freq
        shape.update(_router(a))
    else:
        for name in _MOE_ONLY:
            a.get(name)  # Megatron reads them only with --num-experts
    shape.update(_mla(a))
    shape.update(_window(a))
    shape["mtp_layers"] = a.int("--mtp-num-layers") or 0
    return shape


def _window(a: _Args) -> dict[str, int]:
    """``--window-size L,R`` (Megatron-Core's window: a query sees the L keys before it and R
    after) and ``--window-attn-skip-freq N`` (one full-attention layer after every N - 1
    windowed ones) → attention_window = L + 1 (the window counts the query's own key),
    full_attention_every = N. A list pattern for the skip frequency is refused."""
    size, freq = a.get("--window-size"), a.get("--window-attn-skip-freq")
    if size is None:
        return {}
    try:
        left, right = (int(v) for v in str(size).strip("()").split(","))
    except ValueError:
        raise SpecError("--window-size", size, "two integers left,right (e.g. 127,0)") from None
    if left < 0 or right != 0:
        raise SpecError("--window-size", size, "a causal window: left >= 0, right 0")
    out = {"attention_window": left + 1}
    if freq is not None:
        out["full_attention_every"] = as_int(freq, "--window-attn-skip-freq")
    return out


# Flags Megatron-LM reads only for a mixture of experts (TransformerConfig's moe_* fields).
_MOE_ONLY = (
    "--moe-layer-freq",
    "--moe-expert-capacity-factor",
    "--moe-router-num-groups",
    "--moe-router-group-topk",
    "--moe-router-score-function",
    "--moe-router-topk-scaling-factor",
    "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate",
    "--moe-router-load-balancing-type",
    "--moe-aux-loss-coeff",
)


def _router(a: _Args) -> dict[str, Any]:
    """The MoE router fields, with Megatron-LM's defaults (transformer_config.py at d98e8a6:
    moe_expert_capacity_factor None, moe_router_num_groups / group_topk None,
    moe_router_score_function "softmax", moe_router_topk_scaling_factor None,
    moe_router_enable_expert_bias False with moe_router_bias_update_rate 1e-3; arguments.py
    --moe-aux-loss-coeff 0.0)."""
    score = a.get("--moe-router-score-function", "softmax")
    if score not in ("softmax", "sigmoid"):
        raise SpecError("--moe-router-score-function", score, "aihpc prices softmax | sigmoid")
    rate = a.float("--moe-router-bias-update-rate", 1e-3)
    coeff = a.get("--moe-aux-loss-coeff", "0")
    coeffs = coeff if isinstance(coeff, list) else [coeff]
    balance = a.get("--moe-router-load-balancing-type", "aux_loss")
    if len(coeffs) != 1 or isinstance(balance, list):
        raise SpecError("--moe-aux-loss-coeff", coeff, "aihpc prices one balance loss")
    return {
        "moe_capacity_factor": a.float("--moe-expert-capacity-factor"),
        "moe_router_groups": a.int("--moe-router-num-groups") or 0,
        "moe_router_group_topk": a.int("--moe-router-group-topk") or 0,
        "moe_router_score_function": score,
        "moe_router_topk_scaling_factor": a.float("--moe-router-topk-scaling-factor", 1.0),
        "moe_router_bias_update_rate": rate if a.flag("--moe-router-enable-expert-bias") else 0.0,
        # "none" balances nothing, whatever the coefficient
        "moe_aux_loss_coeff": 0.0
        if balance == "none"
        else as_float(coeffs[0], "--moe-aux-loss-coeff"),
    }


def _mla(a: _Args) -> dict[str, Any]:
    """Multi-latent attention, with arguments.py's defaults (_add_mla_args at d98e8a6:
    --q-lora-rank None, --kv-lora-rank 32, --qk-head-dim 128, --qk-pos-emb-head-dim 64,
    --v-head-dim 128). Megatron's qk_head_dim is the part of a query/key head without RoPE."""
    names = ("--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim")
    if not a.flag("--multi-latent-attention"):
        for name in (*names, "--v-head-dim"):
            a.get(name)  # read only with --multi-latent-attention
        return {}
    return {
        "q_lora_rank": a.int("--q-lora-rank"),
        "kv_lora_rank": a.int("--kv-lora-rank", 32),
        "qk_nope_head_dim": a.int("--qk-head-dim", 128),
        "qk_rope_head_dim": a.int("--qk-pos-emb-head-dim", 64),
        "v_head_dim": a.int("--v-head-dim", 128),
    }


def _pattern(text: str) -> list[int]:
    """A ``--moe-layer-freq`` list expression (``[0]*3+([1]+[0])*29``) → its list, read without
    eval: terms ``[a,b,...]`` or ``(expr)``, each optionally ``*N``, joined by ``+``."""
    tokens = re.findall(r"\d+|[][()*+,]", text)
    if "".join(tokens) != text:
        raise SpecError("--moe-layer-freq", text, "a list expression like ([0]*3+[1]*58)")
    pos = 0

    def take() -> str:
        nonlocal pos
        if pos >= len(tokens):
            raise SpecError("--moe-layer-freq", text, "a list expression like ([0]*3+[1]*58)")
        pos += 1
        return tokens[pos - 1]

    def expr() -> list[int]:
        out = term()
        while pos < len(tokens) and tokens[pos] == "+":
            take()
            out = out + term()
        return out

    def term() -> list[int]:
        t = take()
        if t == "(":
            out = expr()
            if take() != ")":
                raise SpecError("--moe-layer-freq", text, "unbalanced parentheses")
        elif t == "[":
            out = []
            while (t := take()) != "]":
                if t != ",":
                    out.append(as_int(t, "--moe-layer-freq"))
        else:
            raise SpecError("--moe-layer-freq", text, "a list expression like ([0]*3+[1]*58)")
        if pos < len(tokens) and tokens[pos] == "*":
            take()
            out = out * as_int(take(), "--moe-layer-freq")
        return out

    out = expr()
    if pos != len(tokens):
        raise SpecError("--moe-layer-freq", text, "a list expression like ([0]*3+[1]*58)")
    return out


def _layer_freq(freq: Any, num_layers: int) -> tuple[int, int]:
    """``--moe-layer-freq`` → (first_dense_layers, moe_layer_freq). Megatron reads an integer N
    as "layer i is MoE when i % N == 0" and a list expression as the per-layer pattern
    (arguments.py moe_freq_type); aihpc prices K dense layers, then one MoE layer in every F."""
    text = str(freq).replace(" ", "")
    if text.isdigit():
        n = as_int(text, "--moe-layer-freq")
        layers = [1 if i % n == 0 else 0 for i in range(num_layers)]
    else:
        layers = _pattern(text)
    if len(layers) != num_layers or set(layers) - {0, 1} or 1 not in layers:
        raise SpecError(
            "--moe-layer-freq", freq, f"a 0/1 pattern of num_layers {num_layers} with an MoE layer"
        )
    moe = [i for i, v in enumerate(layers) if v]
    first = moe[0]
    step = moe[1] - moe[0] if len(moe) > 1 else num_layers - first
    regular = moe == list(range(first, num_layers, step))[: len(moe)]
    if not regular or (num_layers - first) // step != len(moe):
        raise SpecError(
            "--moe-layer-freq", freq, "aihpc prices K dense layers, then one MoE layer in every F"
        )
    return first, step


def _freq_pattern(num_layers: int, first: int, freq: int) -> str | None:
    """The ``--moe-layer-freq`` for K dense layers then one MoE layer in every F (None: 1)."""
    if first == 0 and freq == 1:
        return None
    if freq == 1:
        return f"([0]*{first}+[1]*{num_layers - first})"
    n, rest = divmod(num_layers - first, freq)
    terms = [f"[0]*{first}"] if first else []
    terms.append(f"([1]+[0]*{freq - 1})*{n}")
    terms += [f"[0]*{rest}"] if rest else []
    return "(" + "+".join(terms) + ")"


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


def _parallel(a: _Args, num_layers: int, world: int, moe: bool = False) -> dict[str, Any]:
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
        "offload_layers": a.int("--cpu-offloading-num-layers", 0)
        if a.flag("--cpu-offloading")
        else 0,
    }
    return out


def _dispatcher(a: _Args, notes: list[str]) -> str:
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
            "--moe-token-dispatcher-type allgather (Megatron's default) priced as alltoall"
        )
    elif kind != "alltoall":
        raise SpecError("--moe-token-dispatcher-type", kind, "allowed: allgather | alltoall | flex")
    return "alltoall"


def _expert_gemm(a: _Args) -> str:
    """How Megatron-LM runs the local experts' GEMMs (arguments.py; perf/moe_kernels.py):
    without --moe-grouped-gemm a SequentialMLP (one MLP per expert) and with it TEGroupedMLP
    (Transformer Engine's GroupedLinear, one cuBLAS GEMM per expert on its default path) are
    both one launch per expert; --moe-use-legacy-grouped-gemm selects GroupedMLP, one grouped
    GEMM kernel per projection (the grouped_gemm library's CUTLASS kernels)."""
    grouped, legacy = a.flag("--moe-grouped-gemm"), a.flag("--moe-use-legacy-grouped-gemm")
    return "grouped" if grouped and legacy else "per_expert"


def _cuda_graphs(a: _Args) -> str:
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


def _schedule(a: _Args, gbs: int, notes: list[str]) -> tuple[float, int | None, int]:
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


def _attention_kernel(a: _Args) -> str:
    """The attention kernel class: TE's fused attention, local with flash-attn (FA2), or the
    unfused local path."""
    impl = a.get("--transformer-impl", "transformer_engine")
    backend = a.get("--attention-backend")
    if backend == "unfused" or (impl == "local" and not a.flag("--use-flash-attn")):
        return "unfused"
    return "flash2" if impl == "local" else "flash"


def _state_dtypes(a: _Args, precision: str) -> tuple[str, str]:
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


def _training(a: _Args, precision: str, gbs: int, notes: list[str]) -> dict[str, Any]:
    lr, train_steps, warmup = _schedule(a, gbs, notes)
    optimizer = a.get("--optimizer", "adam")
    if optimizer not in ("adam", "sgd"):
        raise SpecError("--optimizer", optimizer, "allowed: adam | sgd")
    hidden, attn = a.float("--hidden-dropout", 0.1), a.float("--attention-dropout", 0.1)
    if attn != hidden:
        notes.append(f"--attention-dropout {attn} priced as --hidden-dropout {hidden}")
    attention = _attention_kernel(a)
    cp_comm = a.get("--cp-comm-type", "p2p")
    exchange = {"p2p": "ring", "all_gather": "allgather"}.get(cp_comm)
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
    parallel = _parallel(a, shape["num_layers"], num_gpus, bool(shape.get("num_experts")))
    training = _training(a, _precision(a), parallel["global_batch_size"], notes)
    training["cuda_graphs"] = _cuda_graphs(a)
    if shape.get("num_experts"):
        training["moe_dispatcher"] = _dispatcher(a, notes)
        training["moe_expert_gemm"] = _expert_gemm(a)
    else:
        for name in ("--moe-token-dispatcher-type", "--moe-flex-dispatcher-backend"):
            a.get(name)
        for name in ("--moe-grouped-gemm", "--moe-use-legacy-grouped-gemm"):
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
        freq = _freq_pattern(m.num_layers, m.first_dense_layers, m.moe_layer_freq)
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
