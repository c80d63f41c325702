"""Megatron-LM's launch words → flags: the pretrain_gpt.py arguments of a launch script or an
arguments file, torchrun's node and process counts, and ``Args``, which records the flags an
import read (the rest are named as not priced).

Flag names and defaults are Megatron-LM's at commit d98e8a6 (main, Aug 2026, after
core_v0.15.0): ``megatron/training/arguments.py`` and the dataclass defaults it exposes from
``megatron/core/transformer/transformer_config.py`` and ``model_parallel_config.py``
(hidden_dropout = attention_dropout = 0.1, moe_router_topk = 2, moe_token_dispatcher_type
allgather, expert_tensor_parallel_size = tp, recompute_modules ["core_attn"], weight_decay
0.01, adam_beta2 0.999, clip_grad 1.0, min_lr 0, make_vocab_size_divisible_by 128, position
embeddings learned_absolute, no sequence parallel, no recompute, no distributed optimizer). The
training-loop defaults read here (seed 1234, log_interval 100) are those of arguments.py since
Megatron-LM v2 and unchanged through core_r0.12.0.
"""

from __future__ import annotations

from typing import Any

from aihpc.interop._common import (
    as_float,
    as_int,
)
from aihpc.interop.bash import read_script
from aihpc.interop.shell import launch_command
from aihpc.runspec import SpecError

__all__ = ["FIXED", "FRAMEWORK", "Args", "launcher_counts", "parse_flags", "source_words"]


FRAMEWORK = "Megatron-LM"


# [training] fields Megatron-LM does not let a launch choose: what it runs.
FIXED: dict[str, Any] = {
    "pipeline_split": "even",  # arguments.py asserts num_layers % (pp [* vpp]) == 0
    "fp8_saved_inputs": "fp8",  # Transformer Engine keeps the FP8 cast for the backward
    "kv_repeat": False,
    "fused_kernels": True,  # bias-gelu / bias-dropout / softmax fusions are on by default
    "zero3_gather": "bucketed",
}


def parse_flags(words: list[str]) -> dict[str, Any]:
    """``--flag value...`` words → {"--flag": "value" | [values] | True}, in order; ``_`` in a
    flag's name reads as ``-`` (argparse accepts both spellings only for some; we read both)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(words):
        w = words[i]
        if not w.startswith("--"):
            i += 1
            continue
        name, eq, value = w.partition("=")
        if " " in name or "\t" in name:
            raise SpecError(
                name.split()[0],
                w,
                "Megatron-LM's argparse stops on it (unrecognized arguments): the launch passes "
                "the flag and its value as one word (a quoted array expansion); write them as "
                "two words or expand the array unquoted",
            )
        name = "--" + name[2:].replace("_", "-")
        if eq:
            out[name] = value
            i += 1
            continue
        values = []
        i += 1
        while i < len(words) and not (words[i].startswith("--") and len(words[i]) > 2):
            values.append(words[i])
            i += 1
        out[name] = True if not values else values[0] if len(values) == 1 else values
    return out


def _flag_name(word: str) -> str:
    return "--" + word[2:].replace("_", "-")


def no_value(flags: dict[str, Any], name: str, emptied: dict[str, str] | None) -> None:
    """SpecError when ``name`` was given no value because the word after it expanded to
    nothing (an unset variable), which would otherwise read as a bare ``--name``."""
    for word, source in (emptied or {}).items():
        if _flag_name(word) == name and flags.get(name) is True:
            raise SpecError(
                name,
                source,
                f"{source} is unset where the script runs (neither the script nor an #SBATCH "
                "line sets it), so the flag is given no value: set it, or pass its value",
            )


class Args:
    """The flags, with a record of which ones the import read."""

    def __init__(self, flags: dict[str, Any], emptied: dict[str, str] | None = None) -> None:
        self.flags = flags
        self.read: set[str] = set()
        self.emptied = emptied or {}

    def get(self, name: str, default: Any = None) -> Any:
        self.read.add(name)
        return self.flags.get(name, default)

    def flag(self, name: str) -> bool:
        return self.get(name) is not None and self.get(name) is not False

    def int(self, name: str, default: int | None = None) -> int | None:
        v = self.get(name)
        no_value(self.flags, name, self.emptied)
        return default if v is None else as_int(v, name)

    def float(self, name: str, default: float | None = None) -> float | None:
        v = self.get(name)
        no_value(self.flags, name, self.emptied)
        return default if v is None else as_float(v, name)

    def unread(self) -> list[str]:
        return [f for f in self.flags if f not in self.read]


# Megatron-LM's pretrain_*.py entries that are not a GPT decoder (what aihpc prices).
_NOT_DECODER = {
    "pretrain_bert": "BERT, an encoder",
    "pretrain_t5": "T5, an encoder-decoder",
    "pretrain_retro": "RETRO, a retrieval encoder-decoder",
    "pretrain_ict": "ICT, a BERT retriever",
    "pretrain_vision_classify": "a ViT classifier",
    "pretrain_vision_dino": "a ViT (DINO)",
    "pretrain_vision_inpaint": "a ViT (inpainting)",
    "pretrain_mamba": "a hybrid Mamba model",
    "pretrain_vlm": "a vision-language model",
}


# Variables that say where the ranks meet, not what they run: a default taken for them is not
# an assumption about the plan, so it is not a note.
_RENDEZVOUS = {"MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "RANK", "SLURM_NODEID", "SLURM_PROCID"}


def source_words(
    text: str, notes: list[str] | None = None, emptied: dict[str, str] | None = None
) -> tuple[list[str], list[str]]:
    """(launcher words, Megatron arguments) of a launch script, or ([], words) of a file of
    arguments; the assumptions made reading the script are appended to ``notes``, the flags
    whose value expanded to nothing put in ``emptied``."""
    script = read_script(text)
    found = launch_command(script)
    if notes is not None:
        notes += script.notes
        for n in found[3] if found else []:
            if n not in notes and n.split(" ", 1)[0][1:] not in _RENDEZVOUS:
                notes.append(n)
    if found is not None:
        launcher, entry, words, _, empty = found
        if emptied is not None:
            emptied.update(empty)
        if entry in _NOT_DECODER:
            raise SpecError(
                "SOURCE",
                f"{entry}.py",
                f"it trains {_NOT_DECODER[entry]}, not a decoder-only GPT: aihpc prices "
                "decoder-only transformers (pretrain_gpt.py)",
            )
        if entry != "pretrain_gpt":
            raise SpecError("SOURCE", f"{entry}.py", "aihpc reads pretrain_gpt.py launches")
        return launcher, words
    words = [w for cmd in script.commands for w in cmd.launcher + cmd.words]
    if not any(w.startswith("--") for w in words):
        raise SpecError(
            "SOURCE", text[:40], "expected a script running pretrain_gpt.py or its --arguments"
        )
    return [], words


def launcher_counts(
    words: list[str], emptied: dict[str, str] | None = None
) -> tuple[int | None, int | None]:
    """(nodes, processes per node) from torchrun's / python -m torch.distributed.run's words
    (torchrun's --nnodes defaults to 1, as --standalone sets it)."""
    flags = parse_flags(words)
    for name in ("--nnodes", "--nproc-per-node"):
        no_value(flags, name, emptied)
    nproc = flags.get("--nproc-per-node")
    nnodes = flags.get("--nnodes")
    nodes = as_int(str(nnodes).split(":")[-1], "--nnodes") if nnodes else None
    per_node = as_int(nproc, "--nproc-per-node") if nproc and str(nproc).isdigit() else None
    if nodes is None and per_node is not None:
        nodes = 1
    return nodes, per_node
