"""verl's PPO/GRPO trainer config → a run spec with ``[rl]``.

SOURCE is verl's Hydra config as a YAML file (``ppo_trainer.yaml``-shaped) or a launch script
that runs ``python3 -m verl.trainer.main_ppo key=value ...`` (verl's example scripts; or its DAPO
recipe, ``recipe.dapo.main_dapo``, whose dynamic sampling sets ``rl.generation_batch``): the
script is read by the bash reader (interop/bash.py, never run), its ``key=value`` words (and
``+key=value``) are applied as Hydra applies overrides, with OmegaConf (``${...}`` resolved). The
keys verl's ``ppo_trainer.yaml`` defaults and aihpc reads are below (``_DEFAULTS``, the values of
its config); the rest are named as not priced. verl's ``main_ppo`` runs the hybrid engine
(actor, rollout and reference on the same GPUs): placement colocated, on-policy.
"""

from __future__ import annotations

from typing import Any

from aihpc.interop._common import Imported, cluster_table, model_table, packed_bin_sequences
from aihpc.interop.bash import read_script
from aihpc.interop.hf.reader import hf_model_shape
from aihpc.runspec import SpecError, model_presets

__all__ = ["import_verl"]

FRAMEWORK = "verl"
_ENTRY = "verl.trainer.main_ppo"
# verl's DAPO recipe (recipe/dapo/main_dapo.py in verl until 2026-01, then the verl-recipe
# repository): main_ppo's config plus data.gen_batch_size and algorithm.filter_groups, and a
# trainer that generates gen_batch_size prompts a round, drops the groups whose rewards all
# agree and runs more rounds until train_batch_size groups are kept (dapo_ray_trainer.py)
_DAPO_ENTRY = "recipe.dapo.main_dapo"
_ENTRIES = (_ENTRY, _DAPO_ENTRY)
# verl's defaults of the keys read here: verl 0.9.1's shipped _generated_ppo_trainer.yaml (and
# _generated_ppo_megatron_trainer.yaml for actor.megatron.*), which tests/interop checks them
# against; the same in v0.4 but enforce_eager and max_num_seqs.
_DEFAULTS: dict[str, Any] = {
    "data": {
        "max_prompt_length": 512,
        "max_response_length": 512,
        "train_batch_size": 1024,
        "gen_batch_size": None,  # None: train_batch_size (recipe.dapo: ${data.train_batch_size})
    },
    "actor_rollout_ref": {
        "hybrid_engine": True,
        "model": {"path": None, "enable_gradient_checkpointing": True},
        "actor": {
            "strategy": "fsdp",
            "ppo_mini_batch_size": 256,
            "ppo_epochs": 1,
            "use_kl_loss": False,
            "ulysses_sequence_parallel_size": 1,
            # micro-batches: fixed (ppo_micro_batch_size_per_gpu sequences, which verl requires
            # then) unless use_dynamic_bsz packs ppo_max_token_len_per_gpu tokens a GPU
            "use_dynamic_bsz": False,
            "ppo_micro_batch_size": None,
            "ppo_micro_batch_size_per_gpu": None,
            "ppo_max_token_len_per_gpu": 16384,
            # ppo_trainer.yaml's fsdp_config and ppo_megatron_trainer.yaml's megatron: no offload
            "fsdp_config": {"param_offload": False, "optimizer_offload": False},
            "megatron": {
                "param_offload": False,
                "optimizer_offload": False,
                # ppo_megatron_trainer.yaml's layout: one GPU a model copy unless set
                "tensor_model_parallel_size": 1,
                "pipeline_model_parallel_size": 1,
                "context_parallel_size": 1,
                "expert_model_parallel_size": 1,
                "expert_tensor_parallel_size": None,
            },
        },
        "rollout": {
            "n": 1,
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 1,
            "gpu_memory_utilization": 0.5,
            # False since 2025-08-08 (verl ff6978c; True before it: vLLM without CUDA graphs,
            # so a script for an older verl that leaves it unset ran eager: set it True)
            "enforce_eager": False,
            # passed to vLLM since beb6246 (2025-08-09); 1024 until e9405d7 (2026-01-24)
            "max_num_seqs": 256,
        },
    },
    "algorithm": {
        "adv_estimator": "gae",
        "use_kl_in_reward": False,
        "filter_groups": {"enable": False, "max_num_gen_batches": 0},
    },
    "reward_model": {"enable": False},
    "trainer": {"nnodes": 1, "n_gpus_per_node": 8},
}
# verl's top-level config groups (ppo_trainer.yaml)
_GROUPS = (
    "data",
    "actor_rollout_ref",
    "critic",
    "reward_model",
    "custom_reward_function",
    "algorithm",
    "trainer",
    "ray_init",
)
# OmegaConf's resolvers that read the process's environment (oc.decode could assemble one).
_ENVIRONMENT = ("oc.env", "oc.decode")
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


def _entry(words: list[str]) -> str:
    """The verl entry point ``words`` run (``_ENTRIES``, as a module or its file), or ""."""
    for entry in _ENTRIES:
        file = entry.rsplit(".", 1)[-1] + ".py"
        if entry in words or any(w.endswith(file) for w in words):
            return entry
    return ""


def _overrides(text: str, notes: list[str]) -> tuple[list[str], str]:
    """The ``key=value`` words of the script's ``main_ppo`` (or DAPO recipe) command and the
    entry point it runs; Hydra's ``--config-name`` of verl's Megatron config
    (ppo_megatron_trainer, dapo_megatron_trainer) sets the actor's strategy to megatron."""
    script = read_script(text)
    notes += script.notes
    for cmd in script.commands:
        words = cmd.launcher + cmd.words
        entry = _entry(words)
        if entry:
            out = [w.lstrip("+") for w in words if "=" in w and not w.startswith("-")]
            if "megatron" in _config_name(words):
                out.insert(0, "actor_rollout_ref.actor.strategy=megatron")
                notes.append("verl's Megatron config (--config-name): the actor runs Megatron")
            return out, entry
    raise SpecError(
        "SOURCE",
        "a script",
        f"no command runs {' or '.join(_ENTRIES)} (python3 -m {_ENTRY} ...)",
    )


def _is_script(text: str) -> bool:
    """A shell script rather than a YAML config: a shebang, or a command that runs Python."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return bool(lines) and (
        lines[0].startswith("#!") or any(ln.startswith(("python", "ray ")) for ln in lines)
    )


def _config_name(words: list[str]) -> str:
    for i, w in enumerate(words):
        if w.startswith("--config-name="):
            return w.partition("=")[2]
        if w == "--config-name" and i + 1 < len(words):
            return words[i + 1]
    return ""


def _config(text: str, notes: list[str]) -> tuple[dict[str, Any], str]:
    """verl's config merged over its defaults, and the entry point that runs it (a YAML config:
    main_ppo's)."""
    import yaml
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for resolver in _ENVIRONMENT:
        if resolver in text:
            raise SpecError(
                "SOURCE",
                resolver,
                "reads the environment, which an import does not (the run spec would depend on "
                "the shell it was made in): write the value",
            )
    base = OmegaConf.create(_DEFAULTS)
    entry = _ENTRY
    try:
        if any(e in text or e.rsplit(".", 1)[-1] + ".py" in text for e in _ENTRIES):
            words, entry = _overrides(text, notes)
            merged = OmegaConf.merge(base, OmegaConf.from_dotlist(words))
        elif _is_script(text):
            _overrides(text, notes)  # names the entry points it lacks
            raise AssertionError("unreachable")
        else:
            loaded = OmegaConf.create(text)
            if not isinstance(loaded, DictConfig) or not set(loaded) & set(_GROUPS):
                raise SpecError(
                    "SOURCE",
                    "verl config",
                    "neither verl's config (a YAML of its groups: " + ", ".join(_GROUPS) + ") "
                    f"nor a script that runs python3 -m {_ENTRY}",
                )
            merged = OmegaConf.merge(base, loaded)
        out = OmegaConf.to_container(merged, resolve=True)
    except (OmegaConfBaseException, yaml.YAMLError, ValueError) as err:
        if isinstance(err, SpecError):
            raise
        line = f"OmegaConf refuses it: {err}".split("\n")[0]
        raise SpecError("SOURCE", "verl config", line) from None
    assert isinstance(out, dict)
    return out, entry


def _get(cfg: dict[str, Any], dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _bool(cfg: dict[str, Any], dotted: str) -> bool:
    value = _get(cfg, dotted)
    if not isinstance(value, bool):
        raise SpecError(dotted, value, "expected true or false")
    return value


def _int(cfg: dict[str, Any], dotted: str, option: str = "") -> int:
    """The integer at ``dotted``; ``option``: the import's command-line option that stands in
    for it, named when the source leaves it empty (an unset shell variable)."""
    value = _get(cfg, dotted)
    if value is None and option:
        raise SpecError(dotted, value, f"empty in the source (an unset variable?): pass {option}")
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise SpecError(dotted, value, "expected an integer")
    try:
        out = int(value)
    except ValueError:
        raise SpecError(dotted, value, "expected an integer") from None
    if out < 1:
        raise SpecError(dotted, value, "must be >= 1")
    return out


def _float(cfg: dict[str, Any], dotted: str) -> float:
    value = _get(cfg, dotted)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise SpecError(dotted, value, "expected a number") from None


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
    path = _get(cfg, "critic.model.path")
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
    mini = _int(cfg, actor + "ppo_mini_batch_size")
    out: dict[str, Any] = {"global_batch_size": mini * samples}
    strategy = _get(cfg, actor + "strategy")
    if strategy == "megatron":
        for key, name in _MEGATRON.items():
            if _get(cfg, f"{actor}megatron.{key}") is not None:
                out[name] = _int(cfg, f"{actor}megatron.{key}")
    else:
        out["zero_stage"] = 3  # FSDP shards parameters, gradients and optimizer state
        sp = _int(cfg, actor + "ulysses_sequence_parallel_size")
        if sp > 1:
            out["cp"] = sp
            notes.append(f"Ulysses sequence parallel {sp} priced as context parallel {sp}")
    megatron_recompute = _get(
        cfg, actor + "megatron.override_transformer_config.recompute_granularity"
    )
    if strategy == "megatron" and megatron_recompute in ("full", "selective"):
        out["recompute"] = megatron_recompute
    elif strategy != "megatron" and _get(
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
    if _bool(cfg, actor + "use_dynamic_bsz"):
        tokens = _int(cfg, actor + "ppo_max_token_len_per_gpu")
        parallel["micro_batch_size"] = packed_bin_sequences(tokens, parallel, total, seq, notes)
        return "packed"
    if _get(cfg, actor + "ppo_micro_batch_size_per_gpu") is not None:
        if _get(cfg, actor + "ppo_micro_batch_size") is not None:  # verl's ActorConfig too
            raise SpecError(
                actor + "ppo_micro_batch_size",
                _get(cfg, actor + "ppo_micro_batch_size"),
                "set beside ppo_micro_batch_size_per_gpu, which verl refuses: remove it",
            )
        parallel["micro_batch_size"] = _int(cfg, actor + "ppo_micro_batch_size_per_gpu")
        return "unpadded"
    if _get(cfg, actor + "ppo_micro_batch_size") is None:
        raise SpecError(
            actor + "ppo_micro_batch_size_per_gpu",
            None,
            "required without use_dynamic_bsz (verl refuses the run too): set it, or "
            f"{actor}use_dynamic_bsz=True",
        )
    dp = total // (parallel.get("tp", 1) * parallel.get("pp", 1) * parallel.get("cp", 1))
    parallel["micro_batch_size"] = max(1, _int(cfg, actor + "ppo_micro_batch_size") // max(1, dp))
    notes.append(
        f"{actor}ppo_micro_batch_size over {dp} data-parallel ranks: "
        f"{parallel['micro_batch_size']} sequences a micro-batch"
    )
    return "unpadded"


def _offload(cfg: dict[str, Any], notes: list[str]) -> str:
    """``rl.offload``: which of verl's workers moves the actor's state through host memory
    (perf/rl/switch.py), from its strategy and its ``param_offload`` / ``optimizer_offload``."""
    actor = "actor_rollout_ref.actor."
    strategy = _get(cfg, actor + "strategy")
    group = "megatron." if strategy == "megatron" else "fsdp_config."
    params = _bool(cfg, actor + group + "param_offload")
    optimizer = _bool(cfg, actor + group + "optimizer_offload")
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
    train = _int(cfg, "data.train_batch_size")
    filtering = _bool(cfg, "algorithm.filter_groups.enable")
    if entry != _DAPO_ENTRY:
        if filtering:
            unpriced.append("algorithm.filter_groups.enable")
            notes.append(
                "algorithm.filter_groups: main_ppo's v1 trainer generates a dropped group's "
                "prompt again, which depends on the data: set rl.generation_batch to the "
                "prompts a step generates"
            )
        return
    gen = _int(cfg, "data.gen_batch_size") if _get(cfg, "data.gen_batch_size") else train
    if not filtering:
        rl["prompts_per_step"] = gen
        if gen != train:
            notes.append(
                f"{_DAPO_ENTRY} without algorithm.filter_groups trains on every generated "
                f"prompt: data.gen_batch_size {gen} prompts a step"
            )
        return
    rounds = -(-train // gen)
    most = _get(cfg, "algorithm.filter_groups.max_num_gen_batches") or 0
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
    cfg, entry = _config(text, notes)
    adv = _get(cfg, "algorithm.adv_estimator")
    if adv not in _ALGORITHMS:
        raise SpecError("algorithm.adv_estimator", adv, "priced: " + " | ".join(_ALGORITHMS))
    if adv != "gae" and _ALGORITHMS[adv] != adv:  # gae is PPO's own (its critic's values)
        notes.append(
            f"algorithm.adv_estimator {adv} priced as {_ALGORITHMS[adv]}: its advantage is "
            "computed from the rewards on the driver, the phases are the same"
        )
    n = _int(cfg, "actor_rollout_ref.rollout.n")
    prompt = _int(cfg, "data.max_prompt_length")
    cap = _int(cfg, "data.max_response_length")
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
        "prompts_per_step": _int(cfg, "data.train_batch_size"),
        "samples_per_prompt": n,
        "prompt_len": prompt,
        "response_len": mean,
        "max_response_len": cap,
        "ppo_epochs": _int(cfg, "actor_rollout_ref.actor.ppo_epochs"),
        "kl": bool(
            _get(cfg, "actor_rollout_ref.actor.use_kl_loss")
            or _get(cfg, "algorithm.use_kl_in_reward")
        ),
        "placement": "colocated",
        "offload": _offload(cfg, notes),
        "rollout": {
            "tp": _int(cfg, rollout + "tensor_model_parallel_size"),
            "pp": _int(cfg, rollout + "pipeline_model_parallel_size"),
            "gpu_memory_utilization": _float(cfg, rollout + "gpu_memory_utilization"),
            "cuda_graphs": not _bool(cfg, rollout + "enforce_eager"),
            "max_num_seqs": _int(cfg, rollout + "max_num_seqs"),
        },
    }
    unpriced = ["reward_model.enable"] if _get(cfg, "reward_model.enable") else []
    _dynamic_sampling(cfg, entry, rl, unpriced, notes)
    per_node = gpus_per_node or _int(cfg, "trainer.n_gpus_per_node", "--gpus-per-node")
    total = num_gpus or _int(cfg, "trainer.nnodes", "--num-gpus") * per_node
    actor = _model(_get(cfg, "actor_rollout_ref.model.path"), model, notes, model_config)
    if adv == "gae":
        _critic(cfg, actor, rl, notes)
    parallel = _parallel(cfg, n, notes)
    rl["batching"] = _micro_batches(cfg, parallel, total, prompt + cap, notes)
    if _get(cfg, "actor_rollout_ref.actor.strategy") == "megatron":
        rl["variable_seq_lengths"] = True  # verl's Megatron config always sets it
    tables = {
        "model": actor,
        "cluster": cluster_table(gpu, total, per_node),
        "parallel": parallel,
        "rl": rl,
    }
    tables["model"]["seq_length"] = prompt + cap
    return Imported(FRAMEWORK, tables, unpriced, notes)
