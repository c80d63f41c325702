"""What the runtime can train, checked before any process starts: each refusal is one line
naming the field, the value and what is allowed (docs/runtime.md lists them with the reasons)."""

from __future__ import annotations

from pathlib import Path

from aihpc.runspec import RunSpec, SpecError
from aihpc.runspec.rules import (
    trainer_compile_refusal,
    trainer_plan_refusal,
    trainer_training_refusal,
)
from aihpc.runspec.vlm_rules import trainer_vision_refusal
from aihpc.runtime.config import LlamaConfig
from aihpc.runtime.data import ByteTokenizer, token_count, token_vocab_needed
from aihpc.runtime.mesh import ParallelDims
from aihpc.runtime.speed import check_speed
from aihpc.runtime.text_data import HFTokenizer

__all__ = ["check_plan", "check_trainable"]


def check_trainable(
    spec: RunSpec, world_size: int, data: Path | None = None, tokenizer: str | None = None
) -> tuple[LlamaConfig, int, int]:
    """Validate what the runtime needs beyond the spec's own rules: (config, micro-batch size,
    micro-batches per step and data-parallel rank).

    ``data``: text (byte tokenizer, so vocab_size must be 256), a pre-tokenized ``.npy``
    (vocab_size must exceed its largest id; this reads the file once per call) or a ``.jsonl`` /
    ``.parquet`` dataset; ``tokenizer``: a Hugging Face tokenizer.json (vocab_size must hold its
    vocabulary), text_data.py.
    """
    cfg = LlamaConfig.from_spec(spec.model)
    _check_vision(spec, data, tokenizer)
    _check_data(cfg, spec.model.seq_length, data, tokenizer)
    _raise(trainer_training_refusal(spec.training))
    _raise(trainer_compile_refusal(spec.plan(), spec.training))
    # compile's C compiler, FP8's GPU and torchao: what this host has (speed.py)
    check_speed(spec.training)
    dims = check_plan(spec, world_size)
    plan = spec.plan()
    return cfg, plan.micro_batch_size, plan.global_batch_size // (dims.dp * plan.micro_batch_size)


def _check_data(cfg: LlamaConfig, seq: int, data: Path | None, tokenizer: str | None) -> None:
    """The data and tokenizer against the model: enough tokens, ids inside its vocabulary."""
    if tokenizer is not None:
        try:
            HFTokenizer(tokenizer)
        except ValueError as err:
            raise SpecError("--tokenizer", tokenizer, str(err)) from None
    if data is not None:
        try:
            count = token_count(data, tokenizer)
        except (ValueError, UnicodeDecodeError) as err:
            what = {".npy": "a token array", ".jsonl": "JSON lines", ".parquet": "Parquet"}
            raise SpecError(
                "--data", str(data), f"not {what.get(data.suffix, 'UTF-8 text')}: {err}"
            ) from None
        if count < seq + 1:
            raise SpecError(
                "--data", str(data), f"{count} tokens, fewer than model.seq_length {seq} + 1"
            )
    lowest, needed = token_vocab_needed(data, tokenizer)
    if tokenizer is not None and cfg.vocab_size < needed:
        raise SpecError(
            "model.vocab_size",
            cfg.vocab_size,
            f"must be at least {needed} (the vocabulary of tokenizer {tokenizer})",
        )
    if tokenizer is not None:
        return
    if data is not None and data.suffix == ".npy":
        if lowest < 0:
            raise SpecError("--data", str(data), f"token ids must be >= 0; found {lowest}")
        if cfg.vocab_size < needed:
            raise SpecError(
                "model.vocab_size",
                cfg.vocab_size,
                f"must be at least {needed} (largest token id in {data.name} + 1)",
            )
    elif cfg.vocab_size != ByteTokenizer.vocab_size:
        raise SpecError(
            "model.vocab_size",
            cfg.vocab_size,
            f"must be {ByteTokenizer.vocab_size} for text data (the runtime's byte tokenizer); "
            "pre-tokenized .npy data or a --tokenizer takes any vocab_size",
        )


def _check_vision(spec: RunSpec, data: Path | None, tokenizer: str | None) -> None:
    """A vision-language spec: what the trainer's VLM runs (runspec/vlm_rules.py), on the
    image-text samples it generates (runtime/vlm/images.py), not on --data or --tokenizer."""
    if spec.vision is None:
        return
    _raise(trainer_vision_refusal(spec))
    for flag, given in (("--data", data), ("--tokenizer", tokenizer)):
        if given is not None:
            raise SpecError(
                flag,
                str(given),
                "a vision-language run spec trains on the images and captions the trainer "
                "generates (docs/multimodal.md); omit it",
            )


def _raise(problem: SpecError | None) -> None:
    if problem is not None:
        raise problem


def check_plan(spec: RunSpec, world_size: int) -> ParallelDims:
    """The plan's degrees on ``world_size`` processes, or the first rule the trainer refuses
    (``aihpc.runspec.rules``, the rules ``aihpc search`` marks its plans with).

    The spec's own rules (tp divides the heads, 2 x cp divides the sequence, ...) hold already;
    these are the runtime's: the world size is the product of the degrees, what the pipeline
    schedules and tensor parallel can execute, and what the runtime does not implement."""
    plan = spec.plan()
    _raise(trainer_plan_refusal(plan, spec.model, world_size, spec.parallel.dp))
    return ParallelDims.from_plan(plan, world_size)
