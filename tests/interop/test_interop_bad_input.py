# ruff: noqa: E501  (a table of cases, one a line)
"""Bad input to `aihpc import`, `export` and `launch`: exit 2 with one line naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from aihpc.cli import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]
MINIMAL = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --bf16"
DS_JSON = '{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": true}}'
HF_CONFIG = '{"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 64, "sliding_window": 128}'


@pytest.mark.parametrize(
    ("args", "files", "field"),
    [
        (["import", "megatron", "{tmp}/missing.sh"], {}, "SOURCE"),
        (["import", "nemo", "{tmp}/a"], {"a": "x"}, "FRAMEWORK"),
        (["import", "torchtitan", "{tmp}/a.toml"], {"a.toml": "[model"}, "SOURCE"),
        (["import", "torchtitan", "{tmp}/a.toml"], {"a.toml": '[model]\nflavor = "3B"'}, "model.flavor"),
        (["import", "torchtitan", "{tmp}/a.toml"], {"a.toml": "[training]\nsteps = 1"}, "data_parallel_shard_degree"),
        (["import", "deepspeed", "{tmp}/a.json"], {"a.json": '{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": true}}'}, "--model"),
        (["import", "deepspeed", "{tmp}/a.json", "--model", "llama3-8b"], {"a.json": "[1]"}, "SOURCE"),
        (["import", "deepspeed", "{tmp}/a.json", "--model", "llama3-8b"], {"a.json": '{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1}'}, "bf16.enabled"),
        (["import", "megatron", "{tmp}/a.txt", "--num-gpus", "8"], {"a.txt": MINIMAL + " --vocab-size 256"}, "--micro-batch-size"),
        (["import", "megatron", "{tmp}/a.txt", "--num-gpus", "8"], {"a.txt": MINIMAL.replace("64 --num-att", "abc --num-att") + " --micro-batch-size 1 --vocab-size 256"}, "--hidden-size"),
        (["import", "megatron", "{tmp}/a.txt"], {"a.txt": MINIMAL + " --micro-batch-size 1 --vocab-size 256"}, "--num-gpus"),
        (["import", "megatron", "{tmp}/a.txt", "--num-gpus", "8"], {"a.txt": MINIMAL + " --micro-batch-size 1 --vocab-size 256 --window-size 127,5"}, "--window-size"),
        (["import", "megatron", "{tmp}/a.txt", "--num-gpus", "8"], {"a.txt": MINIMAL + " --micro-batch-size 1 --vocab-size 256 --window-size 127,0 --window-attn-skip-freq [1,0]"}, "--window-attn-skip-freq"),
        (["import", "deepspeed", "{tmp}/a.json", "--model", "{tmp}/c.json"], {"a.json": DS_JSON, "c.json": HF_CONFIG.replace('"sliding_window": 128', '"sliding_window": "abc"')}, "--model sliding_window"),
        (["import", "deepspeed", "{tmp}/a.json", "--model", "{tmp}/c.json"], {"a.json": DS_JSON, "c.json": HF_CONFIG.replace('"hidden_size": 64', '"hidden_size": 64.5')}, "--model hidden_size"),
        (["import", "deepspeed", "{tmp}/a.json", "--model", "{tmp}/c.json"], {"a.json": DS_JSON, "c.json": HF_CONFIG.replace('"sliding_window": 128', '"sliding_window": 128, "layer_types": ["full_attention", "sliding_attention"]')}, "--model layer_types"),
        (["import", "megatron", "{tmp}/a.txt", "--num-gpus", "8"], {"a.txt": MINIMAL + " --micro-batch-size 1"}, "--vocab-size"),
        (["export", "examples/llama3-70b.toml", "--to", "nemo"], {}, "--to"),
        (["export", "examples/llama3-70b.toml", "--to", "deepspeed"], {}, "parallel.tp"),
        (["launch", "examples/tiny-train.toml", "--run-dir", "{tmp}/r", "--env", "X"], {}, "--env"),
    ],
)  # fmt: skip
def test_one_line_naming_the_field(
    args: list[str], files: dict[str, str], field: str, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.chdir(ROOT)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    result = runner.invoke(app, [a.replace("{tmp}", str(tmp_path)) for a in args])
    assert result.exit_code == 2, result.output
    assert field in result.stderr and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
