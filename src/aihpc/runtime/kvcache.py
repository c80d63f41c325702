"""The key/value cache of the trainer's Llama for incremental decoding (``Llama.prefill`` and
``Llama.decode_step``; sampling loop in generate.py).

Layout: one K and one V tensor per layer, (batch, kv_heads, capacity, head_dim), allocated at the
first write with the dtype and device of the keys (grouped-query attention caches the kv_heads,
not the query heads). Slots fill left to right, the same number for every row; a batch of prompts
of different lengths is left-padded, and row b's first ``pad[b]`` slots are padding that no query
sees. Row b's token in slot t sits at position t - pad[b] (rotary embeddings and the attention
mask), so each row computes what a forward over its own unpadded tokens computes.

A step over s new tokens (s > 1: prefill or a chunk of one, s = 1: a decode step) lets the query
in slot q see the keys in slots pad[b] <= j <= q. With no padding, an empty cache's prefill is
plain causal attention (the training kernel, ``is_causal``) and a decode step sees every key
(no mask); otherwise the mask is explicit. A padding query sees itself only, so no row of the
softmax is empty (its output is never used).
"""

from __future__ import annotations

import torch

__all__ = ["KVCache", "LayerKV"]


class KVCache:
    """The cache of one batch: ``pad`` (batch,) padding slots at the left of each row,
    ``capacity`` slots per row, ``length`` slots filled."""

    def __init__(self, pad: torch.Tensor, capacity: int, max_positions: int):
        if capacity > max_positions:
            raise ValueError(
                f"KV cache capacity {capacity} (prompt + new tokens) exceeds the model's "
                f"max_seq_len {max_positions} (its rotary tables)"
            )
        self.pad = pad.to(torch.int64)
        self.capacity = capacity
        self.length = 0
        self.k: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self._step: tuple[int, torch.Tensor | None] = (0, None)  # (s, mask) of the step under way

    @classmethod
    def for_prompts(
        cls,
        tokens: torch.Tensor,
        lengths: torch.Tensor | None,
        capacity: int | None,
        max_positions: int,
    ) -> KVCache:
        """A cache for ``tokens`` (batch, s), left-padded to s; ``lengths`` (batch,) the real
        tokens of each row (None: all s); ``capacity`` slots (None: s)."""
        b, s = tokens.shape
        if lengths is None:
            pad = torch.zeros(b, dtype=torch.int64, device=tokens.device)
        else:
            lengths = torch.as_tensor(lengths, device=tokens.device)
            if lengths.shape != (b,) or int(lengths.min()) < 1 or int(lengths.max()) > s:
                raise ValueError(
                    f"lengths {lengths.tolist()}: one per row, each between 1 and the padded "
                    f"prompt length {s}"
                )
            pad = s - lengths
        return cls(pad, s if capacity is None else capacity, max_positions)

    @property
    def batch(self) -> int:
        return int(self.pad.shape[0])

    @property
    def lengths(self) -> torch.Tensor:
        """(batch,) the tokens each row holds, padding left out."""
        return self.length - self.pad

    def nbytes(self) -> int:
        """Bytes the allocated K and V take (every slot, filled or not)."""
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))

    def begin(
        self, s: int, cos_table: torch.Tensor, sin_table: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Start a step over ``s`` new tokens: the mask every layer uses, and the rotary cos,
        sin of the new tokens, (batch, 1, s, head_dim / 2) each, at each row's positions."""
        start = self.length
        if start + s > self.capacity:
            raise ValueError(
                f"KV cache full: {start} slots filled + {s} new > capacity {self.capacity}"
            )
        device = self.pad.device
        slots = torch.arange(start, start + s, device=device)
        positions = (slots[None] - self.pad[:, None]).clamp_min(0)  # (batch, s)
        if int(self.pad.max()) == 0 and (start == 0 or s == 1):
            mask = None  # plain causal (empty cache) or every key (one new token)
        else:
            keys = torch.arange(start + s, device=device)
            seen = (keys[None, None] <= slots[None, :, None]) & (
                keys[None, None] >= self.pad[:, None, None]
            )
            mask = (seen | (keys[None, None] == slots[None, :, None]))[:, None]  # (b, 1, s, k)
        self._step = (s, mask)
        cos_table, sin_table = cos_table.to(device), sin_table.to(device)
        return cos_table[positions][:, None], sin_table[positions][:, None]

    def layer(self, name: str) -> LayerKV:
        return LayerKV(self, name)

    def advance(self) -> None:
        """End the step: its tokens' slots count as filled."""
        self.length += self._step[0]
        self._step = (0, None)


class LayerKV:
    """One layer's view of the cache for the step under way (what attention writes through)."""

    def __init__(self, cache: KVCache, name: str):
        self.cache = cache
        self.name = name

    def append(
        self, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Write the step's keys and values, (batch, kv_heads, s, head_dim), after the filled
        slots; every key and value the step attends to, and its mask (see the module)."""
        c = self.cache
        s, mask = c._step
        if k.shape[2] != s:
            raise ValueError(f"{k.shape[2]} new keys in a step begun for {s}")
        if self.name not in c.k:
            shape = (k.shape[0], k.shape[1], c.capacity, k.shape[3])
            c.k[self.name] = k.new_empty(shape)
            c.v[self.name] = v.new_empty(shape)
        kc, vc = c.k[self.name], c.v[self.name]
        end = c.length + s
        kc[:, :, c.length : end] = k
        vc[:, :, c.length : end] = v
        return kc[:, :, :end], vc[:, :, :end], mask
