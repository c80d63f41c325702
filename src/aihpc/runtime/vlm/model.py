"""The trainer's vision-language model: a ViT encoder and a projector beside the Llama decoder,
the projected image tokens placed in the text sequence where its placeholders are.

``VisionTower``: patches of ``patch_size`` pixels embedded by one linear layer, a learned position
table, ``num_layers`` pre-norm blocks of full (bidirectional, no causal mask) multi-head
attention and a GELU MLP, a final LayerNorm, then the projector: one linear layer to the language
model's width, or two with a GELU between (``projector_hidden``), as LLaVA-1.5's.

``VisionLlama`` is a ``Llama`` with a ``vision`` submodule: parameter names are the decoder's
plus ``vision.*``, so ``Llama.init_weights`` fills them too from (seed, name) and checkpoints
reshard across plans. Its forward takes the tokens and the images; ``embed`` builds the
sequence's input embeddings: the token embeddings with the image tokens in their place, under
context parallel cut to this rank's positions and under sequence parallel to its shard.

Tensor parallel: the encoder is replicated on every TP rank (Megatron-Core's default for a small
ViT), its parameters Replicate DTensors on the TP mesh (every parameter of the model is then a
DTensor there) that its forward reads as local tensors. Every TP rank computes the same full
sequence of embeddings; the cut to its sequence shard is a DTensor redistribute, whose backward
all-gathers the gradient, so every TP rank holds the encoder's whole gradient, the same on all.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils.checkpoint import checkpoint

from aihpc.runspec.vision import VisionSpec
from aihpc.runtime.model import Llama, LlamaConfig
from aihpc.runtime.vlm.images import IMAGE_TOKEN

__all__ = ["VisionLlama", "VisionTower"]


def _local(p: torch.Tensor | None) -> Any:
    return p.to_local() if isinstance(p, DTensor) else p


class _Linear(nn.Module):
    """A linear layer whose weights may be Replicate DTensors (tensor parallel) read locally."""

    def __init__(self, fan_in: int, fan_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(fan_out, fan_in))
        self.bias = nn.Parameter(torch.empty(fan_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, _local(self.weight), _local(self.bias))


class _Norm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], _local(self.weight), _local(self.bias), 1e-6)


class _EncoderBlock(nn.Module):
    def __init__(self, v: VisionSpec):
        super().__init__()
        self.heads = v.num_attention_heads
        self.attention_norm = _Norm(v.hidden_size)
        self.wqkv = _Linear(v.hidden_size, 3 * v.hidden_size)
        self.wo = _Linear(v.hidden_size, v.hidden_size)
        self.ffn_norm = _Norm(v.hidden_size)
        self.w1 = _Linear(v.hidden_size, v.ffn_hidden_size)
        self.w2 = _Linear(v.ffn_hidden_size, v.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, p, d = x.shape
        qkv = self.wqkv(self.attention_norm(x)).view(n, p, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # (n, heads, patches, head_dim) each
        out = F.scaled_dot_product_attention(q, k, v)  # full attention: no causal mask
        x = x + self.wo(out.transpose(1, 2).reshape(n, p, d))
        return x + self.w2(F.gelu(self.w1(self.ffn_norm(x))))


class VisionTower(nn.Module):
    """Images (n, 3, s, s) → language-model tokens (n, (s / patch)^2, dim)."""

    def __init__(self, v: VisionSpec, dim: int, recompute: bool = False):
        super().__init__()
        self.patch = v.patch_size
        self.recompute = recompute  # [multimodal] encoder_recompute = "full": per block
        patches = (v.image_size // v.patch_size) ** 2
        self.patch_embed = _Linear(3 * v.patch_size**2, v.hidden_size)
        self.pos_embed = nn.Parameter(torch.empty(patches, v.hidden_size))
        self.blocks = nn.ModuleList(_EncoderBlock(v) for _ in range(v.num_layers))
        self.norm = _Norm(v.hidden_size)
        hidden = v.projector_hidden
        self.proj1 = _Linear(v.hidden_size, hidden or dim)
        self.proj2 = _Linear(hidden, dim) if hidden else None

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        n, c, s, _ = images.shape
        g, p = s // self.patch, self.patch
        # (n, c, g, p, g, p) → (n, g*g patches, c*p*p pixels), patches in row-major order
        x = images.view(n, c, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(n, g * g, c * p * p)
        x = self.patch_embed(x) + _local(self.pos_embed)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.recompute else block(x)
        x = self.proj1(self.norm(x))
        return self.proj2(F.gelu(x)) if self.proj2 is not None else x


class VisionLlama(Llama):
    """A Llama whose input holds images: ``forward(tokens, images)``."""

    def __init__(
        self,
        cfg: LlamaConfig,
        vision: VisionSpec,
        recompute: str = "none",
        recompute_modules: tuple[str, ...] = (),
        encoder_recompute: bool = False,
    ):
        super().__init__(cfg, recompute, recompute_modules)
        self.vision: VisionTower | None = VisionTower(vision, cfg.dim, encoder_recompute)
        self.image_tokens = vision.tokens_per_tile
        self.tp_mesh: Any = None  # tensor parallel: the mesh the embeddings are cut over
        self.sequence_parallel = False
        self.cp = 1
        self.encoder_s = 0.0  # the encoder's forward seconds since the last reset
        self.images_seen = 0

    def forward(self, tokens: torch.Tensor, images: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.run_layers(self.embed(tokens, images), self.layers.values(), last=True)

    def embed(self, tokens: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        """tokens (batch, seq) of the whole sequence, images (batch, slots, 3, s, s) →
        embeddings (batch, seq', dim) of this rank's tokens (its CP positions, its SP shard)."""
        assert self.tok_embeddings is not None and self.vision is not None
        h = _local(self.tok_embeddings(tokens))
        placeholder = tokens == IMAGE_TOKEN
        count = placeholder.sum(1) // self.image_tokens  # images of each row
        real = torch.arange(images.shape[1], device=images.device)[None] < count[:, None]
        t0 = time.perf_counter()
        tokens_out = self.vision(images[real])  # (images, tokens each, dim), rows in order
        self.encoder_s += time.perf_counter() - t0
        self.images_seen += int(real.sum())
        h = h.masked_scatter(placeholder[..., None], tokens_out.to(h.dtype))
        if self.cp > 1:
            h = h[:, self.positions]
        if self.tp_mesh is not None and self.sequence_parallel:
            whole = DTensor.from_local(h, self.tp_mesh, [Replicate()], run_check=False)
            h = whole.redistribute(self.tp_mesh, [Shard(1)]).to_local()
        return h
