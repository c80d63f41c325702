"""verl's PPO/GRPO trainer config → a run spec with ``[rl]``.

SOURCE is verl's Hydra config as a YAML file (``ppo_trainer.yaml``-shaped) or a launch script
that runs ``python3 -m verl.trainer.main_ppo key=value ...`` (verl's example scripts; or its DAPO
recipe, ``recipe.dapo.main_dapo``, whose dynamic sampling sets ``rl.generation_batch``): the
script is read by the bash reader (interop/bash.py, never run), its ``key=value`` words (and
``+key=value``) are applied as Hydra applies overrides, with OmegaConf (``${...}`` resolved). The
keys verl's ``ppo_trainer.yaml`` defaults and aihpc reads are in interop/verl_config.py
(``DEFAULTS``, the values of its config); the rest are named as not priced. verl's ``main_ppo``
runs the hybrid engine (actor, rollout and reference on the same GPUs): placement colocated,
on-policy.
"""

from __future__ import annotations

from typing import Any

from aihpc.interop._common import Imported, cluster_table, model_table, packed_bin_sequences
from aihpc.interop.hf.reader import hf_model_shape
from aihpc.interop.verl_config import (
    DAPO_ENTRY,
    get,
    get_bool,
    get_float,
    get_int,
    read_config,
)
from aihpc.runspec import SpecError, model_presets

__all__ = ["import_verl"]

FRAMEWORK = "verl"
# verl's AdvantageEstimator names (verl/trainer/ppo/core_algos.py, verl 0.9.1) -> [rl] algorithm.
# The advantage itself is computed on the driver from the rewards, so estimators that differ only
# there cost the same phases: group baselines as grpo / rloo, batch-wide or per-token baselines as
# reinforce; remax also generates a greedy response per prompt (ray_trainer.py's gen_max).
_ALGORITHMS = {
    "gae": "ppo",
    "grpo": "grpo",
    "grpo_vectorized": "grpo",
    "grpo_passk": "grpo",
    "opo": "grpo",
    "gpg": "grpo",
    "gdpo": "grpo",  # verl 0.9: GRPO's group normalisation per reward dimension
    "rloo": "rloo",
    "rloo_vectorized": "rloo",
    "reinforce_plus_plus": "reinforce",
    "reinforce_plus_plus_baseline": "reinforce",
    "optimal_token_baseline": "reinforce",
    "tir_optimal_token_baseline": "reinforce",
    "remax": "remax",
}
_MEGATRON = {
    "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp",
    "context_parallel_size": "cp",
    "expert_model_parallel_size": "ep",
    "expert_tensor_parallel_size": "etp",
}


# Checkpoint names' tails that do not change a model's shape (Qwen3-30B-A3B-Base, -Instruct, ...)
_SAME_SHAPE_TAILS = ("-base", "-instruct", "-chat", "-it")


def _model(
    path: Any, model: str | None, notes: list[str], config: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The [model] table: --model (a preset, or a Hugging Face config.json read as ``config``),
    else the preset the model path's name is, less a tail that names a base or tuned checkpoint
    of the same shape."""
    if config is not None:
        return model_table(hf_model_shape(config, None))
    name = model or (str(path).rstrip("/").rsplit("/", 1)[-1].lower() if path else "")
    shape = name
    while not model and shape not in model_presets() and shape.endswith(_SAME_SHAPE_TAILS):
        shape = shape.rsplit("-", 1)[0]
    if shape not in model_presets():
        raise SpecError(
            "--model",
            model or path,
            "name the actor's shape with a preset (aihpc presets): "
            "actor_rollout_ref.model.path is no preset's name",
        )
    if shape != name:
        notes.append(f"model {path} priced as preset {shape} (the same shape)")
    return {"preset": shape}


def _critic(
    cfg: dict[str, Any], actor: dict[str, Any], rl: dict[str, Any], notes: list[str]
) -> None:
    """PPO's critic (``critic.model.path``): ``rl.critic`` where the path names a preset other
    than the actor's; the critic is priced on the actor's layout and micro-batches."""
    path = get(cfg, "critic.model.path")
    name = str(path).rstrip("/").rsplit("/", 1)[-1].lower() if path else ""
    while name not in model_presets() and name.endswith(_SAME_SHAPE_TAILS):
        name = name.rsplit("-", 1)[0]
    if name in model_presets() and name != actor.get("preset"):
        rl["critic"] = name
        notes.append(f"critic.model.path {path} priced as preset {name}")
    else:
        notes.append(
            "critic priced with the actor's shape (critic.model.path names no other preset)"
        )
    notes.append("critic priced on the actor's layout and micro-batches")


def _parallel(cfg: dict[str, Any], samples: int, notes: list[str]) -> dict[str, Any]:
    actor = "actor_rollout_ref.actor."
    mini = get_int(cfg, actor + "ppo_mini_batch_size")
    out: dict[str, Any] = {"global_batch_size": mini * samples}
    strategy = get(cfg, actor + "strategy")
    if strategy == "megatron":
        for key, name in _MEGATRON.items():
            if get(cfg, f"{actor}megatron.{key}") is not None:
                out[name] = get_int(cfg, f"{actor}megatron.{key}")
    else:
        out["zero_stage"] = 3  # FSDP shards parameters, gradients and optimizer state
        sp = get_int(cfg, actor + "ulysses_sequence_parallel_size")
        if sp > 1:
            out["cp"] = sp
            notes.append(f"Ulysses sequence parallel {sp} priced as context parallel {sp}")
    megatron_recompute = get(
        cfg, actor + "megatron.override_transformer_config.recompute_granularity"
    )
    if strategy == "megatron" and megatron_recompute in ("full", "selective"):
        out["recompute"] = megatron_recompute
    elif strategy != "megatron" and get(
        cfg, "actor_rollout_ref.model.enable_gradient_checkpointing"
    ):
        out["recompute"] = "full"
    return out


def _micro_batches(
    cfg: dict[str, Any], parallel: dict[str, Any], total: int, seq: int, notes: list[str]
) -> str:
    """``rl.batching`` and ``parallel.micro_batch_size`` (set in ``parallel``) from the actor's
    micro-batching: with ``use_dynamic_bsz`` verl packs sequences up to
    ``ppo_max_token_len_per_gpu`` tokens (times the context / Ulysses degree, each GPU holding
    its share of a sequence), priced as bins of micro_batch_size x ``seq`` (the prompt and
    response caps); without it a micro-batch is ``ppo_micro_batch_size_per_gpu`` sequences (or
    the older global ``ppo_micro_batch_size`` over the data-parallel ranks), padding removed."""
    actor = "actor_rollout_ref.actor."
    if get_bool(cfg, actor + "use_dynamic_bsz"):
        tokens = get_int(cfg, actor + "ppo_max_token_len_per_gpu")
        parallel["micro_batch_size"] = packed_bin_sequences(tokens, parallel, total, seq, notes)
        return "packed"
    if get(cfg, actor + "ppo_micro_batch_size_per_gpu") is not None:
        if get(cfg, actor + "ppo_micro_batch_size") is not None:  # verl's ActorConfig too
            raise SpecError(
                actor + "ppo_micro_batch_size",
                get(cfg, actor + "ppo_micro_batch_size"),
                "set beside ppo_micro_batch_size_per_gpu, which verl refuses: remove it",
            )
        parallel["micro_batch_size"] = get_int(cfg, actor + "ppo_micro_batch_size_per_gpu")
        return "unpadded"
    if get(cfg, actor + "ppo_micro_batch_size") is None:
        raise SpecError(
            actor + "ppo_micro_batch_size_per_gpu",
            None,
            "required without use_dynamic_bsz (verl refuses the run too): set it, or "
            f"{actor}use_dynamic_bsz=True",
        )
    dp = total // (parallel.get("tp", 1) * parallel.get("pp", 1) * parallel.get("cp", 1))
    parallel["micro_batch_size"] = max(
        1, get_int(cfg, actor + "ppo_micro_batch_size") // max(1, dp)
    )
    notes.append(
        f"{actor}ppo_micro_batch_size over {dp} data-parallel ranks: "
        f"{parallel['micro_batch_size']} sequences a micro-batch"
    )
    return "unpadded"


def _offload(cfg: dict[str, Any], notes: list[str]) -> str:
    """``rl.offload``: which of verl's workers moves the actor's state through host memory
    (perf/rl/switch.py), from its strategy and its ``param_offload`` / ``optimizer_offload``."""
    actor = "actor_rollout_ref.actor."
    strategy = get(cfg, actor + "strategy")
    group = "megatron." if strategy == "megatron" else "fsdp_config."
    params = get_bool(cfg, actor + group + "param_offload")
    optimizer = get_bool(cfg, actor + group + "optimizer_offload")
    if not (params or optimizer):
        return "none"
    if params != optimizer:
        on, off = "param_offload", "optimizer_offload"
        if optimizer:
            on, off = off, on
        notes.append(
            f"{actor}{group}{on} without {off}: priced as verl moves both (an upper bound)"
        )
    if strategy == "megatron":
        return "verl-megatron"
    return "verl-fsdp2" if strategy == "fsdp2" else "verl-fsdp"


def _dynamic_sampling(
    cfg: dict[str, Any], entry: str, rl: dict[str, Any], unpriced: list[str], notes: list[str]
) -> None:
    """DAPO's dynamic sampling (``algorithm.filter_groups``) into ``rl``. verl's DAPO recipe
    (recipe/dapo/dapo_ray_trainer.py) generates ``data.gen_batch_size`` prompts a round and,
    with the filter on, drops the groups whose rewards all agree and runs more rounds until
    ``data.train_batch_size`` groups are kept, training on that many; with it off it trains on
    every generated prompt. How many rounds the filter needs depends on how many groups the data
    leaves unanimous, which a config does not say: the fewest are priced (rl.generation_rounds
    raises them). verl 0.9's main_ppo filters in its v1 trainer instead, refilling each dropped
    group one prompt at a time: not priced, named."""
    train = get_int(cfg, "data.train_batch_size")
    filtering = get_bool(cfg, "algorithm.filter_groups.enable")
    if entry != DAPO_ENTRY:
        if filtering:
            unpriced.append("algorithm.filter_groups.enable")
            notes.append(
                "algorithm.filter_groups: main_ppo's v1 trainer generates a dropped group's "
                "prompt again, which depends on the data: set rl.generation_batch to the "
                "prompts a step generates"
            )
        return
    gen = get_int(cfg, "data.gen_batch_size") if get(cfg, "data.gen_batch_size") else train
    if not filtering:
        rl["prompts_per_step"] = gen
        if gen != train:
            notes.append(
                f"{DAPO_ENTRY} without algorithm.filter_groups trains on every generated "
                f"prompt: data.gen_batch_size {gen} prompts a step"
            )
        return
    rounds = -(-train // gen)
    most = get(cfg, "algorithm.filter_groups.max_num_gen_batches") or 0
    if most > 0 and rounds > most:
        raise SpecError(
            "algorithm.filter_groups.max_num_gen_batches",
            most,
            f"below the {rounds} rounds of data.gen_batch_size {gen} that "
            f"data.train_batch_size {train} needs (verl stops the run there): raise it or 0",
        )
    if gen != train:
        rl["generation_batch"] = gen
    rl["generation_rounds"] = rounds
    notes.append(
        f"dynamic sampling: data.gen_batch_size {gen} prompts a round, {rounds} round(s), the "
        f"fewest that can keep data.train_batch_size {train} groups (more when the filter drops "
        "more: set rl.generation_rounds)"
    )


def import_verl(
    text: str,
    model: str | None = None,
    response_len: int | None = None,
    gpu: str = "h100-sxm",
    num_gpus: int | None = None,
    gpus_per_node: int | None = None,
    model_config: dict[str, Any] | None = None,
) -> Imported:
    """verl's config (YAML) or a launch script with Hydra overrides → run spec with [rl];
    ``num_gpus`` / ``gpus_per_node`` stand in for (and override) trainer.nnodes x
    n_gpus_per_node, which launch scripts often take from the scheduler's environment;
    ``model_config``: the actor's Hugging Face config.json (in place of a preset)."""
    notes: list[str] = []
    cfg, entry = read_config(text, notes)
    adv = get(cfg, "algorithm.adv_estimator")
    if adv not in _ALGORITHMS:
        raise SpecError("algorithm.adv_estimator", adv, "priced: " + " | ".join(_ALGORITHMS))
    if adv != "gae" and _ALGORITHMS[adv] != adv:  # gae is PPO's own (its critic's values)
        notes.append(
            f"algorithm.adv_estimator {adv} priced as {_ALGORITHMS[adv]}: its advantage is "
            "computed from the rewards on the driver, the phases are the same"
        )
    n = get_int(cfg, "actor_rollout_ref.rollout.n")
    prompt = get_int(cfg, "data.max_prompt_length")
    cap = get_int(cfg, "data.max_response_length")
    mean = response_len or max(1, cap // 2)
    if response_len is None:
        notes.append(
            f"mean response length {mean} = half of max_response_length {cap} (a verl config "
            "does not say it): pass --response-len"
        )
    notes.append(f"prompt_len {prompt} = data.max_prompt_length (prompts are at most this)")
    rollout = "actor_rollout_ref.rollout."
    rl = {
        "algorithm": _ALGORITHMS[adv],
        "prompts_per_step": get_int(cfg, "data.train_batch_size"),
        "samples_per_prompt": n,
        "prompt_len": prompt,
        "response_len": mean,
        "max_response_len": cap,
        "ppo_epochs": get_int(cfg, "actor_rollout_ref.actor.ppo_epochs"),
        "kl": bool(
            get(cfg, "actor_rollout_ref.actor.use_kl_loss")
            or get(cfg, "algorithm.use_kl_in_reward")
        ),
        "placement": "colocated",
        "offload": _offload(cfg, notes),
        "rollout": {
            "tp": get_int(cfg, rollout + "tensor_model_parallel_size"),
            "pp": get_int(cfg, rollout + "pipeline_model_parallel_size"),
            "gpu_memory_utilization": get_float(cfg, rollout + "gpu_memory_utilization"),
            "cuda_graphs": not get_bool(cfg, rollout + "enforce_eager"),
            "max_num_seqs": get_int(cfg, rollout + "max_num_seqs"),
        },
    }
    unpriced = ["reward_model.enable"] if get(cfg, "reward_model.enable") else []
    _dynamic_sampling(cfg, entry, rl, unpriced, notes)
    per_node = gpus_per_node or get_int(cfg, "trainer.n_gpus_per_node", "--gpus-per-node")
    total = num_gpus or get_int(cfg, "trainer.nnodes", "--num-gpus") * per_node
    actor = _model(get(cfg, "actor_rollout_ref.model.path"), model, notes, model_config)
    if adv == "gae":
        _critic(cfg, actor, rl, notes)
    parallel = _parallel(cfg, n, notes)
    rl["batching"] = _micro_batches(cfg, parallel, total, prompt + cap, notes)
    if get(cfg, "actor_rollout_ref.actor.strategy") == "megatron":
        rl["variable_seq_lengths"] = True  # verl's Megatron config always sets it
    tables = {
        "model": actor,
        "cluster": cluster_table(gpu, total, per_node),
        "parallel": parallel,
        "rl": rl,
    }
    tables["model"]["seq_length"] = prompt + cap
    return Imported(FRAMEWORK, tables, unpriced, notes)
