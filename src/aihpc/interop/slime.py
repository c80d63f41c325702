"""slime's launch script → a run spec with ``[rl]``.

slime (THUDM/slime) trains with Megatron-LM and generates with SGLang; its example scripts run
``python3 train.py`` (synchronous) or ``train_async.py`` (one step off-policy) under ``ray job
submit``, with Megatron's own flags (parallelism, the model's shape from ``scripts/models/*.sh``)
and slime's: ``--rollout-batch-size`` prompts per step, ``--n-samples-per-prompt``,
``--rollout-max-response-len``, ``--global-batch-size`` samples per optimizer step,
``--rollout-num-gpus-per-engine`` (the SGLang engine's tp), ``--sglang-mem-fraction-static``,
``--sglang-max-running-requests`` (its cap on sequences at once, ``rl.rollout.max_num_seqs``),
``--colocate``, ``--actor-num-nodes`` x ``--actor-num-gpus-per-node`` and ``--rollout-num-gpus``.
The script is read by the bash reader (interop/bash.py, never run); a ``source``d model file is
not followed, so the model comes from the script's flags or --model (a preset).
"""

from __future__ import annotations

from typing import Any

from aihpc.interop._common import Imported, cluster_table, model_table, packed_bin_sequences
from aihpc.interop.bash import read_script
from aihpc.interop.hf.reader import hf_model_shape
from aihpc.interop.megatron.flags import Args, parse_flags
from aihpc.runspec import SpecError, model_presets

__all__ = ["import_slime"]

FRAMEWORK = "slime"
_ENTRIES = {"train.py": 0, "train_async.py": 1}  # -> staleness
_ALGORITHMS = {"grpo": "grpo", "ppo": "ppo", "gspo": "grpo", "reinforce_plus_plus_baseline": "rloo"}
_PARALLEL = {
    "--tensor-model-parallel-size": "tp",
    "--pipeline-model-parallel-size": "pp",
    "--context-parallel-size": "cp",
    "--expert-model-parallel-size": "ep",
    "--expert-tensor-parallel-size": "etp",
}


def _command(text: str, notes: list[str]) -> tuple[list[str], int]:
    script = read_script(text)
    notes += script.notes
    for cmd in script.commands:
        words = cmd.launcher + cmd.words
        for i, w in enumerate(words):
            name = w.rsplit("/", 1)[-1]
            if name in _ENTRIES and i and words[i - 1].startswith("python"):
                return words[i + 1 :], _ENTRIES[name]
    raise SpecError("SOURCE", "a script", "no command runs slime's train.py or train_async.py")


def _need(a: Args, name: str) -> int:
    value = a.int(name)
    if value is None:
        raise SpecError(name, None, "required: slime has no default the plan can take")
    return value


def _rl(a: Args, staleness: int, notes: list[str], response_len: int | None) -> dict[str, Any]:
    cap = _need(a, "--rollout-max-response-len")
    mean = response_len or max(1, cap // 2)
    if response_len is None:
        notes.append(f"mean response length {mean} = half of --rollout-max-response-len {cap}")
    prompt = a.int("--rollout-max-prompt-len") or 512
    if a.get("--rollout-max-prompt-len") is None:
        notes.append("prompt_len 512: the script sets no --rollout-max-prompt-len")
    adv = a.get("--advantage-estimator", "grpo")
    if adv not in _ALGORITHMS:
        raise SpecError("--advantage-estimator", adv, "priced: " + " | ".join(_ALGORITHMS))
    rollout: dict[str, Any] = {"tp": a.int("--rollout-num-gpus-per-engine", 1)}
    mem = a.float("--sglang-mem-fraction-static")
    if mem is not None:
        rollout["gpu_memory_utilization"] = mem
    running = a.int("--sglang-max-running-requests")  # SGLang's cap on sequences at once
    if running is not None:
        rollout["max_num_seqs"] = running
    return {
        "algorithm": _ALGORITHMS[adv],
        "prompts_per_step": _need(a, "--rollout-batch-size"),
        "samples_per_prompt": a.int("--n-samples-per-prompt", 1),
        "prompt_len": prompt,
        "response_len": mean,
        "max_response_len": cap,
        "kl": a.flag("--use-kl-loss"),
        "staleness": staleness,
        "rollout": rollout,
    }


def _micro_batches(
    a: Args, parallel: dict[str, Any], train: int, rl: dict[str, Any], notes: list[str]
) -> str:
    """``rl.batching`` and ``parallel.micro_batch_size`` (set in ``parallel``): with
    ``--use-dynamic-batch-size`` slime packs first-fit bins of ``--max-tokens-per-gpu`` x the
    context degree tokens (slime/utils/dp_schedule.py), priced as packed bins; without it a
    micro-batch is ``--micro-batch-size`` sequences (slime's default 1), packed without padding."""
    if a.flag("--use-dynamic-batch-size"):
        seq = rl["prompt_len"] + rl["max_response_len"]
        tokens = _need(a, "--max-tokens-per-gpu")
        parallel["micro_batch_size"] = packed_bin_sequences(tokens, parallel, train, seq, notes)
        return "packed"
    parallel["micro_batch_size"] = a.int("--micro-batch-size", 1) or 1
    return "unpadded"


def import_slime(
    text: str,
    model: str | None = None,
    response_len: int | None = None,
    gpu: str = "h100-sxm",
    model_config: dict[str, Any] | None = None,
) -> Imported:
    """A slime launch script → run spec with [rl] (colocated with --colocate, else the
    rollout pool's --rollout-num-gpus beside the actor's nodes); ``model_config``: the actor's
    Hugging Face config.json (in place of a preset)."""
    notes: list[str] = []
    words, staleness = _command(text, notes)
    a = Args(parse_flags(words))
    shape = model_table(hf_model_shape(model_config, None)) if model_config is not None else None
    if shape is None and (model is None or model not in model_presets()):
        raise SpecError(
            "--model",
            model,
            "name the actor with a preset (aihpc presets): slime's model flags "
            "come from a sourced file the import does not follow",
        )
    per_node = a.int("--actor-num-gpus-per-node", 8) or 8
    train = (a.int("--actor-num-nodes", 1) or 1) * per_node
    rl = _rl(a, staleness, notes, response_len)
    colocate = a.flag("--colocate")
    rl["placement"] = "colocated" if colocate else "disaggregated"
    rl["offload"] = "slime"  # its own moves when colocated (perf/rl/switch.py), none apart
    num_gpus = train
    if not colocate:
        rl["rollout_gpus"] = _need(a, "--rollout-num-gpus")
        num_gpus += rl["rollout_gpus"]
    parallel: dict[str, Any] = {"global_batch_size": _need(a, "--global-batch-size")}
    for flag, name in _PARALLEL.items():
        value = a.int(flag)
        if value:
            parallel[name] = value
    if a.flag("--sequence-parallel"):
        parallel["sequence_parallel"] = True
    if a.get("--recompute-granularity") == "full":
        parallel["recompute"] = "full"
    rl["batching"] = _micro_batches(a, parallel, train, rl, notes)
    rl["variable_seq_lengths"] = True  # slime's validate_args always sets Megatron's flag
    tables = {
        "model": {
            **(shape or {"preset": model}),
            "seq_length": rl["prompt_len"] + rl["max_response_len"],
        },
        "cluster": cluster_table(gpu, num_gpus, per_node),
        "parallel": parallel,
        "rl": rl,
    }
    return Imported(FRAMEWORK, tables, a.unread(), notes)
