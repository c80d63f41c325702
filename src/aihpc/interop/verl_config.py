"""verl's Hydra config read as verl reads it: a YAML of its groups, or the ``key=value`` overrides
of a launch script that runs ``verl.trainer.main_ppo`` (or its DAPO recipe's ``main_dapo``),
merged over verl's own defaults of the keys aihpc reads (``DEFAULTS``) with OmegaConf, ``${...}``
resolved; and the typed getters the import reads it with (a bad value is a SpecError naming
the key). interop/verl.py maps the result to a run spec.
"""

from __future__ import annotations

from typing import Any

from aihpc.interop.bash import read_script
from aihpc.runspec import SpecError

__all__ = [
    "DAPO_ENTRY",
    "DEFAULTS",
    "ENTRY",
    "get",
    "get_bool",
    "get_float",
    "get_int",
    "read_config",
]

ENTRY = "verl.trainer.main_ppo"
# verl's DAPO recipe (recipe/dapo/main_dapo.py in verl until 2026-01, then the verl-recipe
# repository): main_ppo's config plus data.gen_batch_size and algorithm.filter_groups, and a
# trainer that generates gen_batch_size prompts a round, drops the groups whose rewards all
# agree and runs more rounds until train_batch_size groups are kept (dapo_ray_trainer.py)
DAPO_ENTRY = "recipe.dapo.main_dapo"
ENTRIES = (ENTRY, DAPO_ENTRY)
# verl's defaults of the keys read here: verl 0.9.1's shipped _generated_ppo_trainer.yaml (and
# _generated_ppo_megatron_trainer.yaml for actor.megatron.*), which tests/interop checks them
# against; the same in v0.4 but enforce_eager and max_num_seqs.
DEFAULTS: dict[str, Any] = {
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
GROUPS = (
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
ENVIRONMENT = ("oc.env", "oc.decode")


def _entry(words: list[str]) -> str:
    """The verl entry point ``words`` run (``ENTRIES``, as a module or its file), or ""."""
    for entry in ENTRIES:
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
    raise _no_entry()


def _no_entry() -> SpecError:
    return SpecError(
        "SOURCE",
        "a script",
        f"no command runs {' or '.join(ENTRIES)} (python3 -m {ENTRY} ...)",
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


def read_config(text: str, notes: list[str]) -> tuple[dict[str, Any], str]:
    """verl's config merged over its defaults, and the entry point that runs it (a YAML config:
    main_ppo's)."""
    import yaml
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for resolver in ENVIRONMENT:
        if resolver in text:
            raise SpecError(
                "SOURCE",
                resolver,
                "reads the environment, which an import does not (the run spec would depend on "
                "the shell it was made in): write the value",
            )
    base = OmegaConf.create(DEFAULTS)
    entry = ENTRY
    try:
        if any(e in text or e.rsplit(".", 1)[-1] + ".py" in text for e in ENTRIES):
            words, entry = _overrides(text, notes)
            merged = OmegaConf.merge(base, OmegaConf.from_dotlist(words))
        elif _is_script(text):  # a launch script of no verl entry point, not a YAML
            raise _no_entry()
        else:
            loaded = OmegaConf.create(text)
            if not isinstance(loaded, DictConfig) or not set(loaded) & set(GROUPS):
                raise SpecError(
                    "SOURCE",
                    "verl config",
                    "neither verl's config (a YAML of its groups: " + ", ".join(GROUPS) + ") "
                    f"nor a script that runs {' or '.join(ENTRIES)}",
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


def get(cfg: dict[str, Any], dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def get_bool(cfg: dict[str, Any], dotted: str) -> bool:
    value = get(cfg, dotted)
    if not isinstance(value, bool):
        raise SpecError(dotted, value, "expected true or false")
    return value


def get_int(cfg: dict[str, Any], dotted: str, option: str = "") -> int:
    """The integer at ``dotted``; ``option``: the import's command-line option that stands in
    for it, named when the source leaves it empty (an unset shell variable)."""
    value = get(cfg, dotted)
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


def get_float(cfg: dict[str, Any], dotted: str) -> float:
    value = get(cfg, dotted)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise SpecError(dotted, value, "expected a number") from None
