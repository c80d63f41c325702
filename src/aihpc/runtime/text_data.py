"""Text datasets and Hugging Face tokenizers for the trainer (``aihpc train --data --tokenizer``).

Data (``--data``), by suffix:

- ``.jsonl``: one JSON object per line, its ``"text"`` string one document (the layout of
  Hugging Face datasets' JSON exports and of most pre-training dumps);
- ``.parquet``: the ``"text"`` column, one document per row (how the Hugging Face Hub stores
  datasets; ``datasets.Dataset.to_parquet`` writes it); needs pyarrow;
- ``.npy``: pre-tokenized ids, used as they are (data.py);
- anything else: UTF-8 text, one document.

Tokenizer (``--tokenizer``): a Hugging Face ``tokenizer.json`` (the file, or a folder holding
one, as ``AutoTokenizer.save_pretrained`` writes it), read by the ``tokenizers`` library with no
network access; ``sample`` names the tiny byte-level BPE tokenizer shipped with aihpc (512 ids,
trained on the shipped Shakespeare sample by ``python -m aihpc.runtime.text_data``). Without
one, text is the byte tokenizer's (data.py).

Documents are encoded without special tokens and each is followed by the tokenizer's end-of-text
token (the first of ``EOS_NAMES`` it has; none if it has none), then concatenated into one token
array, which ``TokenLoader`` cuts into windows exactly as it cuts the byte-level sample: the
same cursor, so a resumed run (any world size) continues with the same batches. Encoding is
deterministic, so every launch (and every rank) builds the same array.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "EOS_NAMES",
    "SAMPLE_TOKENIZER",
    "TEXT_FIELD",
    "HFTokenizer",
    "encode_corpus",
    "read_documents",
    "tokenizer_fingerprint",
]

TEXT_FIELD = "text"
SAMPLE_TOKENIZER = "sample"  # --tokenizer sample: data/sample-bpe-512.json
_SAMPLE_FILE = "sample-bpe-512.json"
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
DOCUMENT_SUFFIXES = (".jsonl", ".parquet")


def read_documents(path: Path) -> Iterator[str]:
    """The documents of ``path`` (module docstring); ValueError naming the line or column when
    the file is not what its suffix says."""
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"line {n} is not JSON ({err.msg})") from None
                text = row.get(TEXT_FIELD) if isinstance(row, dict) else None
                if not isinstance(text, str):
                    raise ValueError(f'line {n} has no "{TEXT_FIELD}" string')
                yield text
    elif path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError("reading .parquet needs pyarrow (pip install 'aihpc[data]')") from None
        table = pq.read_table(path)
        if TEXT_FIELD not in table.column_names:
            raise ValueError(f'no "{TEXT_FIELD}" column (columns: {table.column_names})')
        yield from (t for t in table.column(TEXT_FIELD).to_pylist() if t is not None)
    else:
        yield path.read_text(encoding="utf-8")


def _tokenizer_file(spec: str | Path) -> Path:
    if str(spec) == SAMPLE_TOKENIZER:
        return Path(str(resources.files("aihpc.runtime").joinpath("data", _SAMPLE_FILE)))
    path = Path(spec)
    return path / "tokenizer.json" if path.is_dir() else path


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer from a local tokenizer.json."""

    def __init__(self, spec: str | Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError("--tokenizer needs tokenizers (pip install 'aihpc[data]')") from None
        self.path = _tokenizer_file(spec)
        if not self.path.is_file():
            raise ValueError(f"{self.path} not found (expected a tokenizer.json)")
        try:
            self.tok = Tokenizer.from_file(str(self.path))
        except Exception as err:  # the Rust side raises its own Exception type
            raise ValueError(f"{self.path} is not a tokenizers file: {err}") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        ids = [self.tok.token_to_id(name) for name in EOS_NAMES]
        self.eos_id: int | None = next((i for i in ids if i is not None), None)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


def encode_corpus(path: Path, tokenizer: HFTokenizer | None, batch: int = 1024) -> np.ndarray:
    """Every document of ``path`` as one token array: the tokenizer's ids (int32) with its
    end-of-text token after each document, or, without a tokenizer, the documents' UTF-8 bytes
    (uint8) joined by newlines. Kept for the process's next call on the same unchanged file
    and tokenizer (the launch's checks, then its loader), read-only."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, tokenizer and str(tokenizer.path))
    if key not in _ENCODED:
        _ENCODED.clear()  # one corpus per process
        _ENCODED[key] = _encode(path, tokenizer, batch)
        _ENCODED[key].flags.writeable = False
    return _ENCODED[key]


_ENCODED: dict[tuple, np.ndarray] = {}


def _encode(path: Path, tokenizer: HFTokenizer | None, batch: int) -> np.ndarray:
    docs = read_documents(path)
    if tokenizer is None:
        return np.frombuffer("\n".join(docs).encode("utf-8"), dtype=np.uint8).copy()
    parts: list[np.ndarray] = []
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    chunk: list[str] = []

    def flush() -> None:
        for enc in tokenizer.tok.encode_batch(chunk, add_special_tokens=False):
            parts.append(np.asarray(enc.ids + eos, dtype=np.int32))
        chunk.clear()

    for doc in docs:
        chunk.append(doc)
        if len(chunk) == batch:
            flush()
    flush()
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def tokenizer_fingerprint(spec: str | Path) -> str:
    """What identifies a tokenizer for a resumed run: the SHA-256 of its tokenizer.json."""
    data = _tokenizer_file(spec).read_bytes()
    return f"tokenizer.json sha256 {hashlib.sha256(data).hexdigest()[:16]}"


def train_sample_tokenizer(out: Path, vocab_size: int = 512) -> Any:
    """The shipped sample tokenizer: byte-level BPE (every UTF-8 text encodes, no unknown
    token) with ``vocab_size`` ids, ``<|endoftext|>`` among them, trained on the shipped
    Shakespeare sample. Deterministic for a given tokenizers version."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = resources.files("aihpc.runtime").joinpath("data", "shakespeare.txt").read_text("utf-8")
    tok.train_from_iterator(text.split("\n\n"), trainer=trainer)
    tok.save(str(out))
    return tok


if __name__ == "__main__":  # regenerate the shipped tokenizer
    target = Path(str(resources.files("aihpc.runtime").joinpath("data", _SAMPLE_FILE)))
    train_sample_tokenizer(target)
    print(f"wrote {target}")
