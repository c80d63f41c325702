"""Run spec with ``[rl]`` → a verl launch script: ``python3 -m verl.trainer.main_ppo`` with the
Hydra overrides that make verl run the plan (the keys of verl 0.9.1's shipped trainer configs,
``_generated_ppo_trainer.yaml`` and, for a Megatron actor, ``_generated_ppo_megatron_trainer.yaml``
through ``--config-name ppo_megatron_trainer``). What verl's ``main_ppo`` cannot run is refused,
naming the field: it is colocated and on-policy (its hybrid engine), its reference is the
actor's initial weights, and a reward model's own config is not written here. PPO's critic is
written on the actor's layout, offload and micro-batches (``critic.*``), as the step model
prices it.

The actor runs FSDP where the plan shards everything over data parallel alone (ZeRO-3, no
tensor, pipeline or expert parallelism; context parallelism as Ulysses), else Megatron (its
distributed optimizer: ZeRO-1). Micro-batches follow ``rl.batching``: packed as verl's dynamic
ones, capped at the plan's ``micro_batch_size`` sequences of the longest prompt and response,
unpadded as its fixed ``ppo_micro_batch_size_per_gpu`` (``perf/rl/batching.py`` prices both).
The model and the data are the user's to name: the script asks for ``MODEL_PATH`` and leaves
verl's default data files, each with a note.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import replace

from aihpc.runspec import RunSpec, SpecError

__all__ = ["export_verl", "verl_as_run"]

FRAMEWORK = "verl"
_ESTIMATORS = {
    "ppo": "gae",  # with verl's critic worker (critic.*)
    "grpo": "grpo",
    "rloo": "rloo",
    "reinforce": "reinforce_plus_plus",
    "remax": "remax",
}
_MEGATRON = (
    ("tensor_model_parallel_size", "tp"),
    ("pipeline_model_parallel_size", "pp"),
    ("context_parallel_size", "cp"),
    ("expert_model_parallel_size", "ep"),
)


def _refusals(spec: RunSpec) -> None:
    rl = spec.rl
    if rl is None:
        raise SpecError("rl", None, "verl runs RL post-training: the run spec needs [rl]")
    if rl.placement != "colocated" or rl.staleness:
        raise SpecError(
            "rl.placement",
            rl.placement,
            "verl's main_ppo runs colocated and on-policy (its hybrid engine): colocated, "
            "staleness 0",
        )
    if rl.algorithm not in _ESTIMATORS:
        raise SpecError(
            "rl.algorithm",
            rl.algorithm,
            "exported: " + " | ".join(_ESTIMATORS),
        )
    if rl.reward == "model":
        raise SpecError("rl.reward", "model", 'exported: "rule" (a reward model is not written)')
    if rl.reference and rl.reference != spec.model.name:
        raise SpecError(
            "rl.reference", rl.reference, "verl's reference is the actor's own initial weights"
        )
    if rl.weight_sync not in ("auto", "cuda_ipc"):
        raise SpecError(
            "rl.weight_sync", rl.weight_sync, "verl's hybrid engine syncs in place: auto | cuda_ipc"
        )  # fmt: skip
    if rl.generated_prompts != rl.prompts_per_step:
        raise SpecError(
            "rl.generation_batch" if rl.generation_batch else "rl.generation_rounds",
            rl.generation_batch or rl.generation_rounds,
            "exported: none (main_ppo's dynamic sampling generates what its filter drops, no "
            "count the script can set): remove it to export the step without it",
        )
    if rl.batching == "padded":
        raise SpecError(
            "rl.batching",
            "padded",
            "verl removes the padding: packed (use_dynamic_bsz) | unpadded "
            "(ppo_micro_batch_size_per_gpu)",
        )
    plan = spec.plan()
    if plan.global_batch_size % rl.samples_per_prompt:
        raise SpecError(
            "parallel.global_batch_size",
            plan.global_batch_size,
            f"must be whole prompts of rl.samples_per_prompt {rl.samples_per_prompt}: verl's "
            "ppo_mini_batch_size counts prompts",
        )
    if rl.rollout.ep > 1:
        raise SpecError(
            "rl.rollout.ep",
            rl.rollout.ep,
            "exported: 1 (verl's expert-parallel rollout is not written)",
        )
    if rl.rollout.precision != "bf16":
        raise SpecError(
            "rl.rollout.precision",
            rl.rollout.precision,
            "exported: bf16 (verl's rollout quantization is not written)",
        )


def _actor(spec: RunSpec, notes: list[str]) -> tuple[str, list[str]]:
    """(the config name, the actor's overrides)."""
    plan = spec.plan()
    actor = "actor_rollout_ref.actor."
    if not _megatron(spec):
        strategy = "fsdp2" if _verl_offload(spec) == "verl-fsdp2" else "fsdp"
        out = [f"{actor}strategy={strategy}"]
        if plan.cp > 1:
            out.append(f"{actor}ulysses_sequence_parallel_size={plan.cp}")
            notes.append(f"context parallel {plan.cp} written as Ulysses sequence parallel")
        checkpointing = plan.recompute != "none"
        out.append(f"actor_rollout_ref.model.enable_gradient_checkpointing={checkpointing}")
        return "ppo_trainer", out
    if plan.zero_stage != 1:
        notes.append(
            f"parallel.zero_stage {plan.zero_stage} runs as ZeRO-1: verl's Megatron actor "
            "always shards the optimizer (its distributed optimizer)"
        )
    return "ppo_megatron_trainer", _megatron_layout(spec, actor)


def _megatron_layout(spec: RunSpec, role: str) -> list[str]:
    """A Megatron worker's degrees and recompute under ``role`` (the actor's or the critic's
    config group: both carry the same ``megatron`` keys in verl 0.9.1)."""
    plan = spec.plan()
    out = [f"{role}megatron.{key}={getattr(plan, name)}" for key, name in _MEGATRON]
    if plan.etp:
        out.append(f"{role}megatron.expert_tensor_parallel_size={plan.etp}")
    if plan.vpp and plan.vpp > 1:
        out.append(f"{role}megatron.virtual_pipeline_model_parallel_size={plan.vpp}")
    override = f"{role}megatron.override_transformer_config."
    if plan.recompute == "full":
        out += [
            f"{override}recompute_granularity=full",
            f"{override}recompute_method=uniform",
            f"{override}recompute_num_layers=1",
        ]
    elif plan.recompute == "selective":
        out.append(f"{override}recompute_granularity=selective")
    return out


def _critic(spec: RunSpec, config: str) -> list[str]:
    """PPO's critic (verl's ``critic`` group) on the actor's layout, offload and micro-batches,
    as the step model prices it (perf/rl/step.py trains the critic under the actor's plan)."""
    rl = spec.rl
    assert rl is not None
    plan = spec.plan()
    critic = "critic."
    if config == "ppo_trainer":
        strategy = "fsdp2" if _verl_offload(spec) == "verl-fsdp2" else "fsdp"
        out = [f"{critic}strategy={strategy}"]
        if plan.cp > 1:
            out.append(f"{critic}ulysses_sequence_parallel_size={plan.cp}")
        out.append(f"{critic}model.enable_gradient_checkpointing={plan.recompute != 'none'}")
        group = "fsdp"
    else:
        out, group = _megatron_layout(spec, critic), "megatron"
    on = rl.offload != "none"
    out += [f"{critic}{group}.{key}={on}" for key in ("param_offload", "optimizer_offload")]
    out += _micro_batches(spec, critic)
    out.append(f'{critic}model.path="$CRITIC_PATH"')
    return out


def _megatron(spec: RunSpec) -> bool:
    plan = spec.plan()
    return not (plan.zero_stage == 3 and plan.tp == plan.pp == plan.ep == 1)


def _verl_offload(spec: RunSpec) -> str:
    """The offload verl's worker for the plan makes: none where the spec moves nothing, else its
    Megatron or FSDP worker's (FSDP2 where the spec names FSDP2's own copies)."""
    rl = spec.rl
    assert rl is not None
    if rl.offload == "none":
        return "none"
    if _megatron(spec):
        return "verl-megatron"
    return "verl-fsdp2" if rl.offload == "verl-fsdp2" else "verl-fsdp"


def _max_num_seqs(spec: RunSpec) -> int:
    """The rollout's cap as written: the spec's, else an engine's share of the step (what the
    priced engine may hold at once; verl's own default, 256, could cut it)."""
    rl = spec.rl
    assert rl is not None
    if rl.rollout.max_num_seqs:
        return rl.rollout.max_num_seqs
    engines = max(1, spec.cluster.num_gpus // rl.rollout.gpus_per_engine)
    return math.ceil(rl.samples_per_step / engines)


def verl_as_run(spec: RunSpec) -> tuple[RunSpec, list[str]]:
    """(the run spec as verl runs the exported script, each change "field = ours -> verl's"):
    NeMo-RL's switch becomes verl's own offload; a Megatron actor's optimizer is sharded
    (ZeRO-1) and its pipeline stages exchange each micro-batch's shape (Megatron's
    variable_seq_lengths, which verl always sets)."""
    rl = spec.rl
    assert rl is not None
    changes: list[str] = []
    theirs = _verl_offload(spec)
    if theirs != rl.offload:
        changes.append(f"rl.offload = '{rl.offload}' -> '{theirs}'")
        rl = replace(rl, offload=theirs)
    if _megatron(spec) and not rl.variable_seq_lengths:
        if spec.plan().pp > 1:  # named where it moves the price: a pipeline's micro-batches
            changes.append("rl.variable_seq_lengths = false -> true")
        rl = replace(rl, variable_seq_lengths=True)
    parallel = spec.parallel
    zero = spec.plan().zero_stage
    if _megatron(spec) and zero != 1:
        changes.append(f"parallel.zero_stage = {zero} -> 1")
        parallel = replace(parallel, zero_stage=1)
    if rl == spec.rl and parallel == spec.parallel:
        return spec, []
    return replace(spec, rl=rl, parallel=parallel), changes


def _offload(spec: RunSpec, config: str, notes: list[str]) -> list[str]:
    rl = spec.rl
    assert rl is not None
    on = rl.offload != "none"
    if rl.offload in ("nemo-rl", "slime"):
        notes.append(
            f"rl.offload {rl.offload} written as verl's param_offload and optimizer_offload on: "
            "verl moves them inside its own phases (price it as verl-megatron / verl-fsdp)"
        )
    actor = "actor_rollout_ref.actor."
    group = "megatron" if config == "ppo_megatron_trainer" else "fsdp_config"
    return [f"{actor}{group}.{key}={on}" for key in ("param_offload", "optimizer_offload")]


def _micro_batches(spec: RunSpec, role: str = "actor_rollout_ref.actor.") -> list[str]:
    """The plan's micro-batches as verl forms them: ``packed`` as dynamic batching capped at
    micro_batch_size x (prompt + response cap) tokens a micro-batch (verl's cap is per GPU of a
    sequence split over cp, so it is divided by cp); ``unpadded`` as micro_batch_size sequences
    a GPU, for the update and both log-prob passes (verl requires each without dynamic
    batching)."""
    rl = spec.rl
    assert rl is not None
    plan = spec.plan()
    if rl.batching == "packed":
        tokens = math.ceil(plan.micro_batch_size * (rl.prompt_len + rl.response_cap) / plan.cp)
        return [f"{role}use_dynamic_bsz=True", f"{role}ppo_max_token_len_per_gpu={tokens}"]
    mbs = plan.micro_batch_size
    out = [f"{role}use_dynamic_bsz=False", f"{role}ppo_micro_batch_size_per_gpu={mbs}"]
    if role == "actor_rollout_ref.actor.":  # the rollout's and the reference's log-prob passes
        out += [
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={mbs}",
            f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={mbs}",
        ]
    return out


def _critic_path(spec: RunSpec) -> list[str]:
    """The script's line that names the critic's checkpoint (PPO only)."""
    rl = spec.rl
    assert rl is not None
    if rl.algorithm != "ppo":
        return []
    if rl.critic:
        return [f': "${{CRITIC_PATH:?set CRITIC_PATH to the checkpoint of {rl.critic}}}"']
    return [': "${CRITIC_PATH:=$MODEL_PATH}"']


def export_verl(spec: RunSpec, source: str = "") -> tuple[str, list[str]]:
    """(the launch script, notes on what the user must still name or what changes as verl runs
    it); SpecError naming the field verl's main_ppo cannot run."""
    _refusals(spec)
    rl = spec.rl
    assert rl is not None
    notes: list[str] = []
    plan, cluster = spec.plan(), spec.cluster
    config, actor = _actor(spec, notes)
    prompt, cap = rl.prompt_len, rl.response_cap
    notes.append(
        f"data.max_prompt_length {prompt} is rl.prompt_len, the mean prompt: raise it to your "
        "data's longest (verl filters longer prompts); the mean response "
        f"({rl.response_len}) is the data's, not a setting"
    )
    notes.append("data.train_files / data.val_files are verl's defaults: add your own")
    per_node = cluster.gpus_per_node
    mini = plan.global_batch_size // rl.samples_per_prompt  # verl counts prompts
    overrides = [
        f"algorithm.adv_estimator={_ESTIMATORS[rl.algorithm]}",
        "algorithm.use_kl_in_reward=False",
        f"data.train_batch_size={rl.prompts_per_step}",
        f"data.max_prompt_length={prompt}",
        f"data.max_response_length={cap}",
        'actor_rollout_ref.model.path="$MODEL_PATH"',
        *actor,
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
        f"actor_rollout_ref.actor.ppo_epochs={rl.ppo_epochs}",
        *_micro_batches(spec),
        f"actor_rollout_ref.actor.use_kl_loss={rl.kl}",
        *_offload(spec, config, notes),
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.n={rl.samples_per_prompt}",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={rl.rollout.tp}",
        f"actor_rollout_ref.rollout.pipeline_model_parallel_size={rl.rollout.pp}",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={rl.rollout.gpu_memory_utilization}",
        f"actor_rollout_ref.rollout.enforce_eager={not rl.rollout.cuda_graphs}",
    ]
    overrides.append(f"actor_rollout_ref.rollout.max_num_seqs={_max_num_seqs(spec)}")
    if rl.algorithm == "ppo":
        overrides += _critic(spec, config)
        notes.append(
            "PPO's critic written on the actor's layout, offload and micro-batches (as priced); "
            + (
                f"CRITIC_PATH names the {rl.critic} checkpoint"
                if rl.critic
                else "CRITIC_PATH defaults to MODEL_PATH (a critic of the actor's shape)"
            )
        )
    overrides += [
        f"trainer.nnodes={max(1, cluster.num_gpus // per_node)}",
        f"trainer.n_gpus_per_node={min(per_node, cluster.num_gpus)}",
    ]
    name = f" --config-name {config}" if config != "ppo_trainer" else ""
    lines = [
        "#!/usr/bin/env bash",
        f"# verl (0.9.1's config keys) for {source or 'a run spec'}, by `aihpc export --to verl`:",
        f"# {spec.model.name} on {cluster.num_gpus} x {cluster.gpu.id}, {rl.algorithm.upper()} "
        f"{rl.prompts_per_step} prompts x {rl.samples_per_prompt} samples, colocated",
        "set -euo pipefail",
        f': "${{MODEL_PATH:?set MODEL_PATH to the checkpoint of {spec.model.name}}}"',
        *_critic_path(spec),
        f"python3 -m verl.trainer.main_ppo{name} \\",
    ]
    for i, item in enumerate(overrides):
        key, _, value = item.partition("=")
        value = value if value.startswith('"$') else shlex.quote(value)
        tail = " \\" if i < len(overrides) - 1 else ""
        lines.append(f"    {key}={value}{tail}")
    return "\n".join(lines) + "\n", notes
