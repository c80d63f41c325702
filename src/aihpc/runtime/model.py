"""A Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) for one device.

Parallelism is applied from outside (parallelize.py, tp.py, pp.py). The model is meant to be
built on the ``meta`` device, parallelised, moved with ``to_empty`` and then filled by
``init_weights``, which draws every parameter from its own seeded generator so the initial weights
do not depend on the plan, the world size or the global RNG.

What parallelism needs from the model, and nothing more:
- layers live in a ModuleDict keyed by their index, so a pipeline stage that keeps layers 4-7
  keeps their names (``layers.5.attention.wq.weight``) and checkpoints reshard across plans;
- the embedding, the final norm and the output may be ``None`` (on stages that do not hold them);
- attention reads its head counts from the tensors it gets (tensor parallel gives it a slice
  of the heads);
- ``layout`` (a buffer) holds the global positions of the tokens of every context-parallel
  rank, one row each, and ``positions`` is this rank's row, so context parallel can hand each
  rank any subset of the sequence; ``Attention.cp_group`` switches its core to ring attention
  over that group, which masks every rank's block by its row.

Incremental decoding (``prefill``, ``decode_step``, ``extend``) runs the same layers over new
tokens with their keys and values in a ``kvcache.KVCache``; generation is generate.py's.
"""

from __future__ import annotations

import functools
import math
import zlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from aihpc.runspec._table import check_choice
from aihpc.runspec.parallel import RECOMPUTE
from aihpc.runspec.rules import TRAINER_RECOMPUTE_MODULES as RECOMPUTE_MODULES_RUN
from aihpc.runtime.config import LlamaConfig
from aihpc.runtime.kvcache import KVCache
from aihpc.runtime.moe import MoE

__all__ = ["Llama", "LlamaConfig"]

_aten = torch.ops.aten
# The fused attention kernels SDPA dispatches to; "op" recompute keeps their outputs.
_ATTENTION_OPS = frozenset(
    op
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if (op := getattr(getattr(_aten, name, None), "default", None)) is not None
)


def _op_level_contexts() -> Any:
    """Selective-checkpoint contexts for ``recompute = "op"`` (aihpc's definition, the policy
    torchtitan calls op-level SAC): keep the attention kernel's outputs and every other matmul
    output of the block (wq, wv, w1, w2 of this decoder), recompute the rest.

    One counter per pass: the recompute pass sees the block's matmuls in the forward's order, so
    counting them again picks the same ones.
    """
    seen = {False: 0, True: 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in _ATTENTION_OPS:
            return CheckpointPolicy.MUST_SAVE
        if op is _aten.mm.default:
            seen[ctx.is_recompute] += 1
            if seen[ctx.is_recompute] % 2:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (autocast would otherwise do it in bf16), then cast back.
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def rope_tables(
    seq_len: int, head_dim: int, theta: float, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (seq_len, head_dim / 2) (Su et al. 2021, RoFormer eq. 34)."""
    inv = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    )
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim); rotates consecutive pairs (x[2i], x[2i+1]). cos, sin:
    (seq', head_dim / 2), of which the first ``seq`` rows are used, or (batch, 1, seq,
    head_dim / 2), each row's own positions (cached decoding of left-padded prompts)."""
    seq = x.shape[-2]
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = (cos[:seq], sin[:seq]) if cos.dim() == 2 else (cos, sin)
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, recompute_core: bool = False):
        super().__init__()
        self.recompute_core = recompute_core  # recompute = "selective": the attention core
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.num_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.dim, bias=False)
        self.cp_group: Any = None  # context parallel: ring attention over this group

    def _qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape  # (batch, seq, dim); under tensor parallel wq/wk/wv give local heads
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (b, heads, s, head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: torch.Tensor
    ) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        core = _causal_attention
        if self.cp_group is not None:
            from aihpc.comm.ring import ring_attention

            core = functools.partial(ring_attention, group=self.cp_group, positions=layout)
        if self.recompute_core:
            out = checkpoint(core, q, k, v, use_reentrant=False)
        else:
            out = core(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def forward_cached(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: Any
    ) -> torch.Tensor:
        """Incremental decoding: x's tokens (batch, s, dim) follow the ones ``kv`` (a
        ``kvcache.LayerKV``) holds; their K/V join it and they attend to every key it lets them
        see (its mask: causal, without the left padding; None: all of them)."""
        if self.cp_group is not None:
            raise ValueError("cached decoding runs without context parallel (cp_group is set)")
        b, s, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        k, v, mask = kv.append(k, v)
        gqa = q.shape[1] != k.shape[1]
        if mask is None and s > 1:  # an empty cache and no padding: the training kernel
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # GQA: each group of q_heads / kv_heads query heads shares one K/V head.
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


class FeedForward(nn.Module):
    """SwiGLU (Shazeer 2020): w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """One decoder layer. ``recompute`` (the run spec's parallel.recompute): full re-runs the
    whole layer in the backward, op keeps what ``_op_level_contexts`` keeps, selective re-runs
    the attention core; the checkpoint sits inside the layer's forward, so FSDP's hooks on the
    layer gather its parameters around the recompute as around the forward."""

    def __init__(
        self,
        cfg: LlamaConfig,
        recompute: str = "none",
        layer_id: int = 0,
        recompute_modules: tuple[str, ...] = (),
    ):
        super().__init__()
        self.recompute = recompute
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, recompute_core=recompute == "selective")
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        moe = cfg.moe is not None and cfg.moe.is_moe_layer(layer_id)
        self.feed_forward = MoE(cfg.moe) if moe else FeedForward(cfg)
        # Fine-grained recompute (parallel.recompute_modules, Megatron-Core's names): the
        # norms' and the dense FFN's forwards run again in the backward (torch checkpoint of
        # each); moe_act: the experts' SwiGLU output is not kept (moe.py).
        self.recompute_norms = "layernorm" in recompute_modules
        self.recompute_mlp = "mlp" in recompute_modules and not moe
        if moe and "moe_act" in recompute_modules:
            self.feed_forward.experts.recompute_act = True

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """x: (batch, seq, dim); rope: (cos, sin) of this rank's tokens and the layout."""
        if self.recompute == "full":
            return checkpoint(self._layer, x, *rope, use_reentrant=False)
        if self.recompute == "op":
            return checkpoint(
                self._layer, x, *rope, use_reentrant=False, context_fn=_op_level_contexts
            )
        return self._layer(x, *rope)

    def _layer(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.attention(
            self._recomputed(self.attention_norm, self.recompute_norms, x), cos, sin, layout
        )
        h = self._recomputed(self.ffn_norm, self.recompute_norms, x)
        return x + self._recomputed(self.feed_forward, self.recompute_mlp, h)

    @staticmethod
    def _recomputed(module: nn.Module, recompute: bool, x: torch.Tensor) -> torch.Tensor:
        """``module(x)``, its forward run again in the backward when ``recompute``."""
        return checkpoint(module, x, use_reentrant=False) if recompute else module(x)

    def forward_cached(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: Any
    ) -> torch.Tensor:
        """The layer on new tokens after the ones ``kv`` holds (incremental decoding)."""
        x = x + self.attention.forward_cached(self.attention_norm(x), cos, sin, kv)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(
        self, cfg: LlamaConfig, recompute: str = "none", recompute_modules: tuple[str, ...] = ()
    ):
        super().__init__()
        check_choice("parallel.recompute", recompute, RECOMPUTE)
        for name in recompute_modules:
            check_choice("parallel.recompute_modules", name, RECOMPUTE_MODULES_RUN)
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict(
            {str(i): Block(cfg, recompute, i, recompute_modules) for i in range(cfg.num_layers)}
        )
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tied_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Derived, not state (non-persistent, rebuilt by init_weights): the RoPE tables and the
        # global positions of the tokens of each context-parallel rank (one rank, all of them).
        cos, sin = rope_tables(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("layout", torch.arange(cfg.max_seq_len)[None], persistent=False)
        self._layout = torch.arange(cfg.max_seq_len, device="cpu")[None]
        self.cp_rank = 0

    @property
    def positions(self) -> torch.Tensor:
        """(seq,) the global positions of the tokens this rank sees, in the data's order."""
        return self.layout[self.cp_rank]

    def set_layout(self, layout: torch.Tensor, cp_rank: int) -> None:
        """Context parallel: CP rank c sees the tokens at the global positions of row c of
        ``layout`` (cp, seq / cp), and this rank is ``cp_rank``. Call before ``init_weights``."""
        self._layout = layout.to("cpu", torch.int64)
        self.cp_rank = cp_rank
        device = self.layout.device
        self.register_buffer(
            "layout", torch.empty(layout.shape, dtype=torch.int64, device=device), False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: (batch, seq) int64 → logits (batch, seq, vocab), on a model that holds every
        part (no pipeline stage removed any)."""
        return self.run_layers(self.tok_embeddings(tokens), self.layers.values(), last=True)

    def prefill(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor | None = None,
        capacity: int | None = None,
        all_logits: bool = False,
    ) -> tuple[torch.Tensor, KVCache]:
        """Incremental decoding, first step: ``tokens`` (batch, s), prompts left-padded to s,
        ``lengths`` (batch,) each row's real tokens (None: all s), ``capacity`` the slots per
        row (prompt + new tokens; None: s) → the last position's logits (batch, vocab), or every
        position's (batch, s, vocab) with ``all_logits``, and the cache (runtime/kvcache.py)."""
        cache = KVCache.for_prompts(tokens, lengths, capacity, self.rope_cos.shape[0])
        return self.extend(tokens, cache, all_logits), cache

    def decode_step(self, tokens: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, KVCache]:
        """One new token per row, (batch,) or (batch, 1), after the ones ``cache`` holds →
        its logits (batch, vocab) and the cache, which now holds it too."""
        return self.extend(tokens.reshape(cache.batch, 1), cache), cache

    def extend(
        self, tokens: torch.Tensor, cache: KVCache, all_logits: bool = False
    ) -> torch.Tensor:
        """``tokens`` (batch, s) after the ones ``cache`` holds, through every layer, their
        K/V added to the cache; logits as ``prefill``'s. Needs the whole model (no pipeline
        stage) on local tensors."""
        if self.tok_embeddings is None or self.output is None or self.norm is None:
            raise ValueError("cached decoding needs the whole model (this is a pipeline stage)")
        cos, sin = cache.begin(tokens.shape[1], self.rope_cos, self.rope_sin)
        h = self.tok_embeddings(tokens)
        for name, layer in self.layers.items():
            h = layer.forward_cached(h, cos, sin, cache.layer(name))
        cache.advance()
        logits = self.output(self.norm(h if all_logits else h[:, -1]))
        return logits

    def rope(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cos, sin) of this rank's tokens, (seq, head_dim / 2) each, and the layout
        (cp, seq): every CP rank's positions, which ring attention masks by."""
        pos = self.positions
        return self.rope_cos[pos], self.rope_sin[pos], self.layout

    def run_layers(self, h: torch.Tensor, layers: Any, last: bool) -> torch.Tensor:
        """h (batch, seq, dim) through ``layers``; with ``last``, the final norm and output."""
        rope = self.rope()
        for layer in layers:
            h = layer(h, rope)
        return self.output(self.norm(h)) if last else h

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter from a generator seeded by (seed, parameter name).

        Each rank draws the full tensor on the CPU and keeps its own shard, so the result is
        bitwise the same for any world size and leaves the global RNG untouched.
        """
        device = self.rope_cos.device
        cos, sin = rope_tables(
            self.cfg.max_seq_len, self.cfg.head_dim, self.cfg.rope_theta, device=device
        )
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        self.layout.copy_(self._layout.to(device))
        # Residual-branch outputs scaled by 1/sqrt(2 * layers) (GPT-2, Radford et al. 2019 §2.3).
        out_std = 0.02 / math.sqrt(2 * self.cfg.num_layers)
        for name, param in self.named_parameters():  # FQNs: the same whatever the plan
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if name.endswith("norm.weight"):
                full = torch.ones(param.shape)
            elif name.endswith(("wo.weight", "w2.weight", "experts.w2")):
                full = torch.randn(param.shape, generator=gen) * out_std
            else:
                full = torch.randn(param.shape, generator=gen) * 0.02
            if isinstance(param, DTensor):
                shard = distribute_tensor(
                    full, param.device_mesh, param.placements, src_data_rank=None
                )
                param.to_local().copy_(shard.to_local())
            else:
                param.copy_(full)
        for module in self.modules():
            if isinstance(module, MoE):
                module.init_buffers()
