"""DeepSpeed's scheduler and batch rules as the reader applies them: WarmupLR / WarmupDecayLR /
WarmupCosineLR steps into the run spec's warm-up and step counts, the HF Trainer's "auto"
scheduler values, and DeepSpeed's batch identity when all three sizes are given."""

from __future__ import annotations

import json

import pytest

from aihpc.interop import import_deepspeed
from aihpc.runspec import SpecError


def _config(**extra: object) -> str:
    base: dict[str, object] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
    }
    return json.dumps({**base, **extra})


def _training(text: str, gpus: int = 8) -> dict:
    return import_deepspeed(text, model="llama3-8b", num_gpus=gpus).tables["training"]


@pytest.mark.parametrize(
    ("kind", "min_ratio"), [("WarmupLR", 1.0), ("WarmupDecayLR", 0.0), ("WarmupCosineLR", None)]
)
def test_explicit_warmup_schedules_give_the_warmup_and_step_counts(
    kind: str, min_ratio: float | None
) -> None:
    params = {"warmup_num_steps": 250, "total_num_steps": 7000, "warmup_type": "linear"}
    if kind != "WarmupCosineLR":
        params["warmup_max_lr"] = 3e-4
    imported = import_deepspeed(
        _config(scheduler={"type": kind, "params": params}), model="llama3-8b", num_gpus=8
    )
    training = imported.tables["training"]
    assert training["warmup_steps"] == 250
    if kind == "WarmupLR":  # WarmupLR takes no total_num_steps: not read, listed as not priced
        assert "train_steps" not in training
        assert "scheduler.params.total_num_steps" in imported.unpriced
    else:
        assert training["train_steps"] == 7000
        assert not any(u.startswith("scheduler") for u in imported.unpriced)
    if min_ratio is not None:
        assert training["min_lr_ratio"] == min_ratio
    spec = imported.spec()
    assert spec.training.warmup_steps == 250


def test_warmup_max_lr_is_the_learning_rate_warmup_lr_sets() -> None:
    text = _config(scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": 900}})
    imported = import_deepspeed(text, model="llama3-8b", num_gpus=8)
    training = imported.tables["training"]
    assert training["learning_rate"] == 0.001  # DeepSpeed's warmup_max_lr default
    assert training["warmup_steps"] == 1000  # DeepSpeed's warmup_num_steps default
    assert any("warmup_max_lr 0.001" in n for n in imported.notes)


def test_auto_scheduler_values_follow_the_hf_trainer_defaults() -> None:
    auto = {k: "auto" for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps")}
    text = _config(
        optimizer={"type": "AdamW", "params": {"lr": "auto"}},
        scheduler={"type": "WarmupDecayLR", "params": {**auto, "total_num_steps": "auto"}},
    )
    imported = import_deepspeed(text, model="llama3-8b", num_gpus=8)
    training = imported.tables["training"]
    assert training["warmup_steps"] == 0  # TrainingArguments warmup_steps 0, warmup_ratio 0
    assert training["learning_rate"] == 5e-5  # warmup_max_lr = learning_rate
    assert "train_steps" not in training  # from max_steps or the data: not known here
    notes = "\n".join(imported.notes)
    assert "scheduler.params.warmup_num_steps" in notes
    assert "scheduler.params.total_num_steps" in notes and "max_steps" in notes


def test_three_batch_sizes_that_break_deepspeeds_identity_are_refused() -> None:
    text = _config(train_batch_size=96)  # 2 x 4 x 8 GPUs = 64
    with pytest.raises(SpecError) as err:
        import_deepspeed(text, model="llama3-8b", num_gpus=8)
    line = str(err.value)
    assert "\n" not in line and line.startswith("train_batch_size = 96")
    assert "2 x 4 x 8 = 64" in line and "gradient_accumulation_steps" in line
    with pytest.raises(SpecError, match="not a multiple of 2 x 4"):
        import_deepspeed(text.replace("96", "100"), model="llama3-8b")
    ok = import_deepspeed(_config(train_batch_size=64), model="llama3-8b", num_gpus=8)
    assert ok.tables["parallel"]["global_batch_size"] == 64
