"""Datasets (.jsonl, .parquet) and Hugging Face tokenizers (runtime/text_data.py): the token
array the trainer's loader cuts, its exact-resume cursor, and the one-line refusals."""

from __future__ import annotations

import json
import shutil
import signal
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import torch
from train_cli import losses, ok
from train_cli import train as run_train

from aihpc.runtime.data import TokenLoader, load_tokens
from aihpc.runtime.text_data import HFTokenizer, read_documents

SAMPLE = resources.files("aihpc.runtime").joinpath("data", "shakespeare.txt").read_text("utf-8")
DOCS = [d for d in SAMPLE.split("\n\n") if d.strip()][:200]


def write_jsonl(path: Path, docs=DOCS) -> Path:
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def test_sample_tokenizer_round_trips_text_and_ends_documents():
    tok = HFTokenizer("sample")
    assert tok.vocab_size == 512 and tok.eos_id is not None
    text = "To be, or not to be -- Ünïcode ✓"
    ids = tok.encode(text)
    assert tok.decode(ids) == text  # byte-level BPE: lossless on any UTF-8
    assert len(ids) < len(text.encode())  # merges learnt: fewer tokens than bytes


def test_jsonl_corpus_is_each_document_then_end_of_text(tmp_path):
    tok = HFTokenizer("sample")
    tokens = load_tokens(write_jsonl(tmp_path / "c.jsonl", DOCS[:3]), "sample")
    expected = [i for d in DOCS[:3] for i in [*tok.encode(d), tok.eos_id]]
    assert tokens.tolist() == expected


def test_parquet_gives_the_same_tokens_as_jsonl(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": DOCS[:50]}), tmp_path / "c.parquet")
    a = load_tokens(tmp_path / "c.parquet", "sample")
    b = load_tokens(write_jsonl(tmp_path / "c.jsonl", DOCS[:50]), "sample")
    assert np.array_equal(a, b)


def test_tokenizer_folder_as_save_pretrained_writes_it(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(HFTokenizer("sample").path, folder / "tokenizer.json")
    assert HFTokenizer(str(folder)).encode("hello") == HFTokenizer("sample").encode("hello")


def test_resume_mid_epoch_gives_the_batches_of_an_uninterrupted_loader(tmp_path):
    """A loader restored from another's state mid-epoch (on a re-encoded corpus, as a new
    launch builds it) yields the same batches, across the epoch boundary, as one that ran on."""
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS[:20])
    whole = TokenLoader(load_tokens(corpus, "sample"), 16, 4, seed=3)
    epoch = whole.num_samples
    assert 7 * 4 < epoch < 40 * 4 // 2  # resumed mid-epoch; 40 batches cross two boundaries
    first = [whole.next_rows(0, 1) for _ in range(40)]
    again = TokenLoader(load_tokens(corpus, "sample"), 16, 4, seed=3)
    for _ in range(7):
        again.next_rows(0, 1)
    state = again.state_dict()
    resumed = TokenLoader(load_tokens(corpus, "sample"), 16, 4, seed=3)
    resumed.load_state_dict(state)
    for x, y in first[7:]:
        rx, ry = resumed.next_rows(0, 1)
        assert torch.equal(x, rx) and torch.equal(y, ry)


SPEC = """
[model]
preset = "tiny-llama"
seq_length = 32
vocab_size = {vocab}
[cluster]
gpu = "h100-sxm"
num_gpus = 1
[parallel]
micro_batch_size = 2
global_batch_size = 4
[training]
train_steps = 6
learning_rate = 3e-3
warmup_steps = 2
[checkpoint]
interval_steps = 3
async_save = false
"""


def train(spec, run_dir, *extra):
    return run_train(spec, run_dir, *extra, timeout=240, env={"OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_trainer_on_jsonl_with_a_tokenizer_resumes_exactly(tmp_path):
    """aihpc train --data c.jsonl --tokenizer sample, killed after its step-3 checkpoint and
    run again: every step's loss bit for bit as the uninterrupted run's."""
    spec = tmp_path / "run.toml"
    spec.write_text(SPEC.format(vocab=512))
    corpus = write_jsonl(tmp_path / "c.jsonl")
    args = ("--data", str(corpus), "--tokenizer", "sample")
    whole = ok(train(spec, tmp_path / "whole", *args))
    killed = train(spec, tmp_path / "k", *args, "--inject", "kill:step=5")
    assert killed.returncode == -signal.SIGKILL
    resumed = ok(train(spec, tmp_path / "k", *args))
    assert resumed["resumed_from_step"] == 3
    assert losses(tmp_path / "k") == losses(tmp_path / "whole")
    assert resumed["state_sha256"] == whole["state_sha256"]
    # the checkpoint names its tokenizer: the same data under another one is another run
    from aihpc.runtime.text_data import train_sample_tokenizer

    train_sample_tokenizer(tmp_path / "other.json", vocab_size=500)
    other = train(
        spec, tmp_path / "k", "--data", str(corpus), "--tokenizer", str(tmp_path / "other.json")
    )
    assert other.returncode == 2 and "tokenizer" in other.stderr, other.stderr[-2000:]


def _refusal(proc) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_refusals_name_the_field_in_one_line(tmp_path):
    spec = tmp_path / "run.toml"
    spec.write_text(SPEC.format(vocab=256))
    corpus = write_jsonl(tmp_path / "c.jsonl")
    line = _refusal(train(spec, tmp_path / "a", "--data", str(corpus), "--tokenizer", "sample"))
    assert "model.vocab_size" in line and "512" in line
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    line = _refusal(train(spec, tmp_path / "b", "--data", str(bad)))
    assert "--data" in line and "line 2" in line
    line = _refusal(train(spec, tmp_path / "c", "--tokenizer", str(tmp_path / "none.json")))
    assert "--tokenizer" in line and "not found" in line


def test_read_documents_skips_blank_lines(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b"}\n')
    assert list(read_documents(path)) == ["a", "b"]
