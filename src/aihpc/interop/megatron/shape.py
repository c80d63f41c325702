"""The model's shape from Megatron-LM arguments: layers, widths, attention (GQA, MLA, sliding
windows), the vocabulary (padded as Megatron pads it), MoE routing and layer patterns, MTP.
"""

from __future__ import annotations

import re
from typing import Any

from aihpc.interop._common import (
    as_float,
    as_int,
    require,
)
from aihpc.interop.megatron.flags import Args
from aihpc.runspec import SpecError

__all__ = ["freq_pattern", "model_shape"]


# Llama 3's tokenizer has 128,256 entries (Meta Llama 3 model card; tokenizer.json).
_KNOWN_TOKENIZERS = {"llama-3": 128256, "llama3": 128256}


def model_shape(a: Args, tp: int, notes: list[str], vocab_size: int | None) -> dict[str, Any]:
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
    theta = a.float("--rotary-base", 10000.0)  # arguments.py's default
    if pos == "rope" and theta != 10000.0:
        shape["rope_theta"] = theta
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


def _window(a: Args) -> dict[str, int]:
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


def _router(a: Args) -> dict[str, Any]:
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


def _mla(a: Args) -> dict[str, Any]:
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


def freq_pattern(num_layers: int, first: int, freq: int) -> str | None:
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


def _vocab(a: Args, tp: int, notes: list[str], given: int | None) -> int:
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
