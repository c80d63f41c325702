# ruff: noqa: E501  (a table of cases, one a line)
"""Inputs the fuzz benchmark (benchmarks/fuzz_inputs.py, issue 42) found a traceback or a hang
on: framework configs and config.json with values of the wrong kind, nested too deep or too big,
and a launch script's shell arithmetic. Each is one line naming the field, exit 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aihpc.cli import app
from aihpc.runspec import SpecError
from hang_bounds import hang_guard_s

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data"
DS = json.loads((DATA / "deepspeed_zero3.json").read_text())
HF = json.loads((DATA / "llama3_8b_config.json").read_text())
MINIMAL = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --bf16 --micro-batch-size 1 --vocab-size 256"
DEEP = "[" * 100_000 + "]" * 100_000


def _ds(**changes: object) -> str:
    doc = json.loads(json.dumps(DS))
    for path, value in changes.items():
        node = doc
        *parents, last = path.split("__")
        for part in parents:
            node = node[part]
        node[last] = value
    return json.dumps(doc)


def _hf(**changes: object) -> str:
    return json.dumps({**HF, **changes})  # NaN / Infinity written as Python's json writes them


def _one_line(result, field: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output, result.output
    assert field in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (_ds(train_batch_size="256"), "train_batch_size"),
        (_ds(train_micro_batch_size_per_gpu={"x": 1}), "train_micro_batch_size_per_gpu"),
        (_ds(gradient_accumulation_steps=[4]), "gradient_accumulation_steps"),
        (_ds(train_micro_batch_size_per_gpu=0), "train_micro_batch_size_per_gpu"),
        (_ds(optimizer__params__lr="fast"), "optimizer.params.lr"),
        (_ds(optimizer__params__betas="0.9"), "optimizer.params.betas"),
        (_ds(communication_data_type={"a": 1}), "communication_data_type"),
        (_ds(bf16={"enabled": "yes"}), "bf16.enabled"),
        (_ds(bf16={"enabled": "auto"}), "bf16.enabled"),  # the Trainer's; its flag is unknown
        (_ds(scheduler__params__cos_min_ratio="0.1"), "scheduler.params.cos_min_ratio"),
        (_ds(zero_optimization__zero_hpz_partition_size="8"), "zero_hpz_partition_size"),
        (_ds(gradient_clipping=float("nan")), "gradient_clipping"),
        ('{"train_batch_size": ' + DEEP + "}", "SOURCE"),
    ],
)
def test_deepspeed_values_of_the_wrong_kind(text: str, field: str, tmp_path: Path) -> None:
    (tmp_path / "ds.json").write_text(text)
    result = runner.invoke(
        app, ["import", "deepspeed", str(tmp_path / "ds.json"), "--model", "llama3-8b"]
    )
    _one_line(result, field)


def test_deepspeed_num_gpus_zero_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "ds.json").write_text(json.dumps(DS))
    result = runner.invoke(
        app,
        [
            "import",
            "deepspeed",
            str(tmp_path / "ds.json"),
            "--model",
            "llama3-8b",
            "--num-gpus",
            "0",
        ],
    )
    _one_line(result, "--num-gpus")


def test_deepspeed_auto_values_take_the_hf_trainer_defaults(tmp_path: Path) -> None:
    """The Hugging Face Trainer's "auto": a value it fills from TrainingArguments is read as that
    argument's default, one it computes (train_batch_size) is left to DeepSpeed's identity;
    each is said on its own line."""
    text = _ds(train_batch_size="auto", gradient_clipping="auto", optimizer__params__lr="auto")
    (tmp_path / "ds.json").write_text(text)
    args = ["import", "deepspeed", str(tmp_path / "ds.json"), "--model", "llama3-8b", "--json"]
    result = runner.invoke(app, [*args, "--num-gpus", "16"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    par, train = doc["runspec"]["parallel"], doc["runspec"]["training"]
    # batch = micro-batch x accumulation x world, with train_batch_size left to the Trainer
    assert (
        par["global_batch_size"]
        == DS["train_micro_batch_size_per_gpu"] * DS["gradient_accumulation_steps"] * 16
    )
    # TrainingArguments' defaults: max_grad_norm 1.0, learning_rate 5e-5
    from aihpc.interop.deepspeed.reader import HF_AUTO

    assert train["grad_clip"] == HF_AUTO["gradient_clipping"][1]
    assert train["learning_rate"] == HF_AUTO["optimizer.params.lr"][1]
    auto = [n for n in doc["notes"] if '"auto"' in n]
    assert {n.split(" ")[0] for n in auto} == {
        "train_batch_size",
        "gradient_clipping",
        "optimizer.params.lr",
    }


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (_hf(hidden_size=float("nan")), "hidden_size"),
        (_hf(num_hidden_layers=float("inf")), "num_hidden_layers"),
        (_hf(vocab_size=None), "vocab_size"),
        (_hf(num_hidden_layers=10**400), "num_hidden_layers"),
        (_hf(hidden_act=["silu"]), "hidden_act"),
        (_hf(routed_scaling_factor=float("-inf"), num_local_experts=8), "routed_scaling_factor"),
        (DEEP, "CONFIG"),
        ("null", "CONFIG"),
    ],
)
def test_hf_config_values_of_the_wrong_kind(text: str, field: str, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(text)
    _one_line(runner.invoke(app, ["import", "hf", str(tmp_path / "config.json")]), field)
    # the same config as DeepSpeed's model
    (tmp_path / "ds.json").write_text(json.dumps(DS))
    result = runner.invoke(
        app,
        [
            "import",
            "deepspeed",
            str(tmp_path / "ds.json"),
            "--model",
            str(tmp_path / "config.json"),
        ],
    )
    _one_line(result, "--model")


@pytest.mark.parametrize("framework", ["hf", "deepspeed", "torchtitan", "megatron"])
def test_a_source_too_big_is_refused_before_it_is_read(framework: str, tmp_path: Path) -> None:
    from aihpc.runspec.inputs import MAX_INPUT_BYTES

    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(MAX_INPUT_BYTES + 1)  # sparse: no disk spent
    result = runner.invoke(app, ["import", framework, str(big), "--model", "llama3-8b"])
    _one_line(result, "SOURCE")
    assert "larger than" in result.stderr


def test_torchtitan_toml_nested_too_deep(tmp_path: Path) -> None:
    (tmp_path / "job.toml").write_text("[model]\nx = " + "[" * 5000 + "]" * 5000 + "\n")
    result = runner.invoke(app, ["import", "torchtitan", str(tmp_path / "job.toml")])
    _one_line(result, "SOURCE")
    assert "nested 5000 deep" in result.stderr


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("TP=$((8/0))", "division by zero"),
        ("TP=$((8%0))", "division by zero"),
        ("TP=$((2**-1))", "negative exponent"),
        ("TP=$((99999999999999999999999))", "19 digits"),
        ("TP=$((09))", "not octal"),
    ],
)
def test_megatron_arithmetic_bash_refuses_is_one_line(line: str, why: str, tmp_path: Path) -> None:
    (tmp_path / "a.sh").write_text(
        f"{line}\npython pretrain_gpt.py {MINIMAL} --tensor-model-parallel-size $TP\n"
    )
    result = runner.invoke(app, ["import", "megatron", str(tmp_path / "a.sh"), "--num-gpus", "8"])
    _one_line(result, "$((...))")
    assert why in result.stderr


def test_megatron_power_tower_is_computed_not_hung(tmp_path: Path) -> None:
    """$((2**2**2**2**2**2)) was Python's eval of a number with 10^19,728 digits: a hang. Now
    it is bash's 64-bit value, at once (a subprocess, so that the old hang fails, not stalls)."""
    script = tmp_path / "a.sh"
    script.write_text(
        f"TP=$((2**2**2**2**2**2))\npython pretrain_gpt.py {MINIMAL} --tensor-model-parallel-size $TP\n"
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "aihpc",
            "import",
            "megatron",
            str(script),
            "--num-gpus",
            "8",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=hang_guard_s(60),
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["runspec"]["parallel"]["tp"] == 1  # 2**65536 wraps to 0; 2**0


BASH_EXPRESSIONS = [
    "1+2*3", "-7/2", "-7%2", "7%-2", "(1+2)*3", "2**63", "2**64", "2**62*4", "010+1",
    "9223372036854775807+1", "2**2**2**2**2**2", "3**40", "-(4)", "- -5", "((((((1))))))*2",
    "1000000007**5", "8 / 3 / 2", "2**3**2",
]  # fmt: skip


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash to compare with")
@pytest.mark.parametrize("expr", BASH_EXPRESSIONS)
def test_arithmetic_is_bashs(expr: str) -> None:
    from aihpc.interop.shell import arith

    out = subprocess.run(
        ["bash", "-c", f"echo $(({expr}))"], capture_output=True, text=True, check=True
    )
    assert arith(expr) == int(out.stdout)


def test_arithmetic_nesting_is_bounded() -> None:
    from aihpc.interop.shell import arith

    with pytest.raises(SpecError, match="nested deeper"):
        arith("(" * 1000 + "1" + ")" * 1000)
    with pytest.raises(SpecError, match="longer than"):
        arith("1+" * 10_000 + "1")
