"""What the runtime can train, checked before any process starts: each refusal is one line
naming the field, the value and what is allowed (docs/runtime.md lists them with the reasons)."""

from __future__ import annotations

from pathlib import Path

from aihpc.runspec import RunSpec, SpecError
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
    _check_data(cfg, spec.model.seq_length, data, tokenizer)
    if spec.training.precision not in ("bf16", "fp8"):
        raise SpecError(
            "training.precision",
            spec.training.precision,
            "the runtime trains with bf16 autocast on GPUs (fp32 on CPUs), FP8 linears on "
            "GPUs through torchao; allowed: bf16, fp8",
        )
    # compile's C compiler and plan, FP8's GPU and torchao (speed.py)
    check_speed(spec.training, spec.plan().tp)
    if spec.training.optimizer != "adamw":
        raise SpecError(
            "training.optimizer", spec.training.optimizer, "the runtime implements adamw"
        )
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


def _refuse(field: str, value: object, allowed: str) -> None:
    raise SpecError(f"parallel.{field}", value, allowed)


def check_plan(spec: RunSpec, world_size: int) -> ParallelDims:
    """The plan's degrees on ``world_size`` processes, or the first rule the runtime refuses.

    The spec's own rules (tp divides the heads, 2 x cp divides the sequence, ...) hold already;
    these are the runtime's: the world size is the product of the degrees, what the pipeline
    schedules and tensor parallel can execute, and what the runtime does not implement yet."""
    plan, model = spec.plan(), spec.model
    dims = ParallelDims.from_plan(plan, world_size)
    given = spec.parallel.dp
    if given is not None and given * plan.tp * plan.pp * plan.cp != world_size:
        product = given * plan.tp * plan.pp * plan.cp
        _refuse("dp", given, f"tp*pp*cp*dp = {product} must equal the world size {world_size}")
    _check_moe(spec, dims)
    if plan.offload_layers:
        _refuse(
            "offload_layers",
            plan.offload_layers,
            "the runtime keeps activations on the device; allowed: 0",
        )
    if model.kv_heads % plan.tp:
        _refuse(
            "tp",
            plan.tp,
            f"must divide num_kv_heads {model.kv_heads} in the runtime "
            "(it does not replicate KV heads)",
        )
    if plan.pp > 1 and model.tied_embeddings:
        _refuse(
            "pp",
            plan.pp,
            "tied embeddings live on the first and the last stage; allowed with pp = 1",
        )
    per_step = dims.dp * plan.micro_batch_size
    if plan.global_batch_size % per_step:
        raise SpecError(
            "parallel.global_batch_size",
            plan.global_batch_size,
            f"must be a multiple of dp {dims.dp} x micro_batch_size {plan.micro_batch_size} "
            f"= {per_step} (dp = world size {world_size} / (tp*pp*cp))",
        )
    _check_schedule(dims, plan.global_batch_size // per_step, model.num_layers)
    return dims


def _check_moe(spec: RunSpec, dims: ParallelDims) -> None:
    """Expert parallel is carved out of the data x context parallel ranks (the mesh dimension
    that holds context parallel: replicas under ZeRO 0, the FSDP shard group otherwise)."""
    model = spec.model
    if not model.is_moe:
        return  # the spec refuses ep > 1 for a dense model
    if dims.tp > 1:
        _refuse(
            "tp",
            dims.tp,
            "the runtime does not split MoE layers over tensor parallel (no expert tensor "
            "parallel); allowed with an MoE model: 1",
        )
    if getattr(model, "moe_aux_loss_coeff", None) and dims.cp > 1:
        _refuse(
            "cp",
            dims.cp,
            "the sequence-wise balance loss needs whole sequences on a rank; allowed with "
            "model.moe_aux_loss_coeff > 0: 1",
        )
    if dims.ep == 1:
        return
    if (dims.dp * dims.cp) % dims.ep:
        _refuse(
            "ep",
            dims.ep,
            f"must divide dp*cp = {dims.dp * dims.cp} (dp = world size / (tp*pp*cp))",
        )
    group = dims.shape[dims.ep_dim]
    if group % dims.ep:
        _refuse(
            "ep",
            dims.ep,
            f"must divide dp_shard*cp = {group}: under HSDP the expert-parallel group is carved "
            "out of the FSDP shard group",
        )


def _check_schedule(dims: ParallelDims, microbatches: int, num_layers: int) -> None:
    """What torch.distributed.pipelining's schedules need: enough micro-batches to fill the
    pipeline, two stages per rank for the V schedule, a layer for every stage."""
    if dims.pp == 1:
        return
    stages = dims.pp * (2 if dims.pp_schedule == "zbv" else dims.vpp)
    if dims.pp_schedule == "zbv" and dims.vpp != 2:
        _refuse("vpp", dims.vpp, "the zbv schedule holds two stages per rank; allowed: 2")
    if dims.pp_schedule != "zbv" and (dims.vpp > 1) != (dims.pp_schedule == "interleaved-1f1b"):
        _refuse("pp_schedule", dims.pp_schedule, "interleaved-1f1b takes vpp > 1, 1f1b vpp = 1")
    if stages > num_layers:
        _refuse(
            "pp",
            dims.pp,
            f"{stages} stages need at least as many layers; the model has {num_layers}",
        )
    if microbatches < dims.pp:
        _refuse(
            "pp",
            dims.pp,
            f"needs at least pp micro-batches per step; the plan has {microbatches} "
            "(global_batch_size / (dp x micro_batch_size))",
        )
