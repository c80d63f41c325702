"""What Megatron-LM runs: the one rule set that both `aihpc export --to megatron` (refusing a
plan) and `aihpc search --for megatron` (keeping the search inside what it runs) apply; the
environment a launch needs, the pipeline layout of an uneven split and the vocabulary as
Megatron pads it.

The rules are Megatron-LM's ``megatron/training/arguments.py`` ``validate_args`` at commit
d98e8a6 (main, Aug 2026); each cites its line there.
"""

from __future__ import annotations

import math

from aihpc.runspec import ModelSpec, ParallelPlan, SpecError, TrainingSpec

__all__ = [
    "cuda_connections",
    "megatron_refusal",
    "megatron_training_refusal",
    "padded_vocab",
    "pipeline_layout",
    "vocab_divisor",
]

# make_vocab_size_divisible_by's default (arguments.py, --make-vocab-size-divisible-by)
VOCAB_DIVISOR = 128


def megatron_refusal(model: ModelSpec, p: ParallelPlan, t: TrainingSpec) -> SpecError | None:
    """The first field of the plan Megatron-LM cannot run, as a SpecError; None if it runs it.
    Depends on neither micro_batch_size nor global_batch_size (the search relies on it)."""
    err = megatron_training_refusal(model, t)
    for check in (_pipeline, _sharding, _kernels):
        if err is not None:
            return err
        err = check(model, p, t)
    return err


def megatron_training_refusal(m: ModelSpec, t: TrainingSpec) -> SpecError | None:
    """What Megatron-LM refuses in the model or training whatever the plan (the search says it
    once, not per plan)."""
    if t.optimizer == "adam":
        return SpecError("training.optimizer", "adam", "Megatron-LM runs adamw (its adam) | sgd")
    if t.optimizer_dtype not in ("fp32", "bf16"):
        return SpecError("training.optimizer_dtype", t.optimizer_dtype, "Megatron-LM: fp32 | bf16")
    if t.attention not in ("flash", "flash2", "unfused"):
        return SpecError(
            "training.attention", t.attention, "Megatron-LM runs flash | flash2 | unfused"
        )
    if t.moe_dispatch_dtype != "bf16" and m.is_moe:
        return SpecError(
            "training.moe_dispatch_dtype",
            t.moe_dispatch_dtype,
            "Megatron-LM dispatches bf16 (its only 8-bit wire type is mxfp8, on the ncclep flex "
            "backend)",
        )
    return None


def _pipeline(m: ModelSpec, p: ParallelPlan, t: TrainingSpec) -> SpecError | None:
    chunks = p.pp * p.vpp
    if p.pp > 1 and t.pipeline_split == "even" and m.num_layers % chunks:
        # arguments.py:985-998: no layout flag, num_layers % pp == 0 (and TransformerConfig
        # the same per virtual stage); an uneven split is written as a layout instead
        return SpecError(
            "training.pipeline_split",
            "even",
            f"pp x vpp = {chunks} must divide num_layers {m.num_layers}, or uneven | balanced "
            "(Megatron-LM's --pipeline-model-parallel-layout)",
        )
    if p.schedule == "zbv":
        return SpecError("parallel.pp_schedule", "zbv", "Megatron-LM runs 1f1b | interleaved-1f1b")
    return None


def _sharding(m: ModelSpec, p: ParallelPlan, t: TrainingSpec) -> SpecError | None:
    if p.zero_stage == 2:
        return SpecError(
            "parallel.zero_stage", 2, "Megatron-LM runs 0 | 1 (distributed optimizer) | 3 (FSDP2)"
        )
    if p.dp_shard is not None and p.dp_shard != p.dp:
        return SpecError("parallel.dp_shard", p.dp_shard, f"Megatron-LM shards over all dp {p.dp}")
    if p.zero_stage == 3:  # --use-torch-fsdp2: arguments.py:1031-1051
        if p.pp > 1:  # :1034
            return SpecError("parallel.pp", p.pp, "Megatron-LM's FSDP2 (zero_stage 3) runs pp 1")
        if p.ep > 1:  # :1036
            return SpecError("parallel.ep", p.ep, "Megatron-LM's FSDP2 (zero_stage 3) runs ep 1")
        if m.tied_embeddings:  # :1044
            return SpecError(
                "model.tied_embeddings",
                True,
                "Megatron-LM's FSDP2 (zero_stage 3) needs untied embeddings: false",
            )
        if t.precision == "fp16":  # :1046
            return SpecError(
                "training.precision", "fp16", "Megatron-LM's FSDP2 (zero_stage 3) runs bf16 | fp8"
            )
    return None


def _kernels(m: ModelSpec, p: ParallelPlan, t: TrainingSpec) -> SpecError | None:
    if p.recompute == "op":
        return SpecError("parallel.recompute", "op", "Megatron-LM runs none | selective | full")
    if p.moe_a2a_overlap == "dualpipe":
        return SpecError(
            "parallel.moe_a2a_overlap",
            "dualpipe",
            "Megatron-LM runs none | 1f1b (--overlap-moe-expert-parallel-comm)",
        )
    return None


def cuda_connections(p: ParallelPlan) -> str | None:
    """CUDA_DEVICE_MAX_CONNECTIONS as the launch must set it: "1" where arguments.py:1453-1479
    asserts it (tp or cp > 1 before Blackwell, unless FSDP or the MoE A2A overlap, which only
    warn; harmless from Blackwell on, where the rule lapses), "unset" under FSDP2, which
    asserts it is not 1 (arguments.py:1048), None where nothing is required."""
    if p.zero_stage == 3:
        return "unset"
    if p.tp > 1 or p.cp > 1:
        return "1"
    return None


def padded_vocab(vocab: int, divisor: int, tp: int) -> int:
    """The vocabulary Megatron-LM builds: --vocab-size rounded up to a multiple of
    make_vocab_size_divisible_by x tp (megatron/core/tokenizers/utils/build_tokenizer.py
    vocab_size_with_padding; NullTokenizer's vocab_size is --vocab-size itself)."""
    multiple = divisor * tp
    return -(-vocab // multiple) * multiple


def vocab_divisor(vocab: int, tp: int) -> int:
    """make_vocab_size_divisible_by for ``vocab`` at ``tp``: the largest ≤ 128 that Megatron
    pads to nothing, or 128 (its default) where tp does not divide the vocabulary."""
    if vocab % tp:
        return VOCAB_DIVISOR
    return math.gcd(vocab // tp, VOCAB_DIVISOR)


def pipeline_layout(m: ModelSpec, p: ParallelPlan, split: str) -> str | None:
    """--pipeline-model-parallel-layout for an uneven or balanced split (E embedding, t a layer,
    m an MTP layer, L the loss, | between stages, in layer order: stage v x pp + rank), or None
    where Megatron's even split is the plan's. uneven: chunks differ by at most a layer, the
    fuller ones in the middle; balanced: the embedding and the loss take a layer's slot each."""
    chunks = p.pp * p.vpp
    if p.pp == 1 or (split != "balanced" and m.num_layers % chunks == 0):
        return None
    units = m.num_layers + (m.mtp_layers + 2 if split == "balanced" else 0)
    base, extra = divmod(units, chunks)
    start = (chunks - extra) // 2  # the `extra` fuller chunks, centred
    sizes = [base + (start <= i < start + extra) for i in range(chunks)]
    items = ["t"] * m.num_layers
    if split == "balanced":
        items = ["E", *items, *(["m"] * m.mtp_layers), "L"]
    stages, first = [], 0
    for n in sizes:
        stages.append(items[first : first + n])
        first += n
    if split != "balanced":
        stages[0].insert(0, "E")
        stages[-1] += ["m"] * m.mtp_layers + ["L"]
    else:  # Megatron keeps every MTP layer in the last stage (TransformerConfig's layout check)
        stages = [[x for x in s if x != "m"] for s in stages]
        stages[-1][-1:-1] = ["m"] * m.mtp_layers
    return "|".join(_compact(s) for s in stages)


def _compact(stage: list[str]) -> str:
    """A stage's letters with runs of t written t*n (Megatron's parse_str_to_list unrolls
    them)."""
    out, i = [], 0
    while i < len(stage):
        j = i
        while j < len(stage) and stage[j] == stage[i]:
            j += 1
        n = j - i
        out.append(stage[i] if n == 1 else f"{stage[i]}*{n}")
        i = j
    return "".join(out)
