"""docs/run-spec.md, generated: every run-spec field with its type, default, allowed values, the
parts of aihpc that read it, and its meaning.

Only the meanings are written by hand (``runspec/data/fields.toml``). Types and defaults come from
the spec dataclasses; allowed values from the checks themselves (each field is given a value of
the wrong sign or name and the one-line error it raises is quoted); "read by" from the source of
the packages that consume run specs. So the page cannot drift from the code:
``tests/runspec/test_run_spec_doc.py`` regenerates it and compares.

    python -m aihpc.runspec.reference > docs/run-spec.md
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import tomllib
import typing
from collections.abc import Callable
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from aihpc.runspec import (
    cluster,
    inference,
    model,
    parallel,
    reliability,
    rl,
    runspec,
    training,
    vision,
)
from aihpc.runspec._table import _allowed_types, _type_name, from_table
from aihpc.runspec.errors import SpecError

__all__ = ["field_docs", "render", "section_fields"]

# Packages that read run specs, and what the page calls them (those not installed are skipped).
READERS = {
    "perf": "planner",
    "goodput": "planner",
    "runtime": "trainer",
    "runspec/rules.py": "trainer",  # the trainer's rules: a field it refuses is one it reads
    "runspec/vlm_rules.py": "trainer",  # the same, for a vision-language model
    "resilience": "trainer",
    "launch": "launch",
    "observe": "observe",
}
LABELS = ("name", "source", "id")  # descriptive fields: shown in output, read by nothing
_SPEC_CLASSES = (
    model.ModelSpec,
    cluster.GPUSpec,
    cluster.ClusterSpec,
    parallel.PartialPlan,
    parallel.ParallelPlan,
    training.TrainingSpec,
    training.CheckpointSpec,
    reliability.ReliabilitySpec,
    rl.RLSpec,
    rl.RolloutSpec,
    inference.InferenceSpec,
    runspec.RunSpec,
    vision.VisionSpec,
    vision.MultimodalSpec,
)
_BASE_GPU = "h100-sxm"  # the part whose figures the [cluster] and gpu_spec probes start from


@cache
def field_docs() -> dict[str, dict[str, Any]]:
    """fields.toml: section -> field -> {"doc": ..., and "default", "allowed", "read_by" where
    the code cannot say it}."""
    text = resources.files("aihpc.runspec").joinpath("data/fields.toml").read_text()
    out: dict[str, dict[str, Any]] = {}
    for section, table in tomllib.loads(text).items():
        out[section] = {k: v if isinstance(v, dict) else {"doc": v} for k, v in table.items()}
    return out


def _init_fields(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if f.init]


def section_fields() -> dict[str, list[str]]:
    """Every key each run-spec table accepts, in the order the code declares them."""
    cluster_keys = list(cluster._CLUSTER_KEYS)
    return {
        "model": ["preset", *(f.name for f in _init_fields(model.ModelSpec))],
        "vision": [f.name for f in _init_fields(vision.VisionSpec)],
        "cluster": cluster_keys,
        "gpu_spec": [f.name for f in _init_fields(cluster.GPUSpec)],
        "parallel": [f.name for f in _init_fields(parallel.PartialPlan)],
        "training": [f.name for f in _init_fields(training.TrainingSpec)],
        "checkpoint": [f.name for f in _init_fields(training.CheckpointSpec)],
        "reliability": [f.name for f in _init_fields(reliability.ReliabilitySpec)],
        "rl": [f.name for f in _init_fields(rl.RLSpec)],
        "rl.rollout": [f.name for f in _init_fields(rl.RolloutSpec)],
        "inference": [f.name for f in _init_fields(inference.InferenceSpec)],
        "multimodal": [f.name for f in _init_fields(vision.MultimodalSpec)],
    }


_CLASS = {
    "model": model.ModelSpec,
    "cluster": cluster.ClusterSpec,
    "gpu_spec": cluster.GPUSpec,
    "parallel": parallel.PartialPlan,
    "training": training.TrainingSpec,
    "checkpoint": training.CheckpointSpec,
    "reliability": reliability.ReliabilitySpec,
    "rl": rl.RLSpec,
    "rl.rollout": rl.RolloutSpec,
    "inference": inference.InferenceSpec,
    "vision": vision.VisionSpec,
    "multimodal": vision.MultimodalSpec,
}
_SPECIAL_TYPES: dict[tuple[str, str], Any] = {
    ("model", "preset"): str,
    ("cluster", "gpu"): str,
    ("cluster", "gpu_spec"): dict,
}
for _d in ("images_per_sample", "image_tokens", "text_tokens"):
    _SPECIAL_TYPES[("multimodal", _d)] = float | dict
_SPECIAL_TYPES[("cluster", "calibration")] = str


def _hint(section: str, name: str) -> Any:
    return _SPECIAL_TYPES.get((section, name)) or typing.get_type_hints(_CLASS[section])[name]


def _type(section: str, name: str) -> str:
    return _type_name(_allowed_types(_hint(section, name)))


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def _default(section: str, name: str) -> str:
    given = field_docs().get(section, {}).get(name, {}).get("default")
    if given is not None:
        return str(given)
    cls = _CLASS[section]
    f = {x.name: x for x in dataclasses.fields(cls)}.get(name)
    if f is None or (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING):
        return "required"
    if section == "parallel":  # not given: searched by `search`, ParallelPlan's for `estimate`
        plan_default = {x.name: x.default for x in dataclasses.fields(parallel.ParallelPlan)}
        return f"searched; estimate: {_fmt(plan_default[name])}"
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    return _fmt(value)


def _builder(section: str) -> Callable[[dict[str, Any]], Any]:
    """Builds the section from a one-field table, the way a run spec would."""
    gpu = cluster.gpu_catalog()[_BASE_GPU]
    clip = {"num_layers": 24, "hidden_size": 1024, "num_attention_heads": 16}
    clip |= {"ffn_hidden_size": 4096, "patch_size": 14}
    return {
        "model": lambda t: model.model_from_table({"preset": "tiny-llama", **t}),
        "vision": lambda t: vision.vision_from_table({**clip, **t}),
        "multimodal": lambda t: vision.multimodal_from_table(t),
        "cluster": lambda t: cluster.cluster_from_table({"gpu": _BASE_GPU, "num_gpus": 8, **t}),
        "gpu_spec": lambda t: from_table(cluster.GPUSpec, {**gpu, **t}, "cluster.gpu_spec"),
    }.get(section, lambda t: from_table(_CLASS[section], t, section))


def _allowed(section: str, name: str) -> str:
    """What the code accepts, in its own words: the error a wrong value raises."""
    given = field_docs().get(section, {}).get(name, {}).get("allowed")
    if given is not None:
        return str(given)
    allowed = _allowed_types(_hint(section, name))
    if str in allowed:
        probe: Any = "?"
    elif float in allowed:
        probe = -1.0
    elif int in allowed and bool not in allowed:
        probe = -1
    else:
        return ""
    where = {"gpu_spec": "cluster.gpu_spec", "vision": "model.vision"}.get(section, section)
    try:
        _builder(section)({name: probe})
    except SpecError as err:
        if err.field == f"{where}.{name}":
            return err.allowed.removeprefix("allowed: ")
    return ""


@cache
def _aliases() -> dict[str, set[str]]:
    """field -> names that read it: itself, and the spec properties and methods whose code reads
    ``self.<field>`` (``peak_tflops()`` reads bf16_tflops, ``nvlink_domain`` scale_up_domain)."""
    direct: dict[str, set[str]] = {}
    for cls in _SPEC_CLASSES:
        for attr, member in vars(cls).items():
            func = member.fget if isinstance(member, property) else member
            if not inspect.isfunction(func) or attr.startswith("__"):
                continue
            for used in re.findall(r"self\.(\w+)", inspect.getsource(func)):
                direct.setdefault(used, set()).add(attr)
    out: dict[str, set[str]] = {}
    for name in direct:  # transitively: sustained_peak_tflops() reads clock_ratio reads tdp_w
        seen, todo = set(), [name]
        while todo:
            for reader in direct.get(todo.pop(), ()):
                if reader not in seen:
                    seen.add(reader)
                    todo.append(reader)
        out[name] = seen
    return out


@cache
def _reader_sources() -> dict[str, str]:
    root = Path(__file__).resolve().parents[1]
    out: dict[str, str] = {}
    for package, reader in READERS.items():
        where = root / package
        for path in [where] if where.suffix == ".py" else sorted(where.rglob("*.py")):
            out[reader] = out.get(reader, "") + path.read_text(encoding="utf-8") + "\n"
    return out


def _read_by(section: str, name: str) -> str:
    given = field_docs().get(section, {}).get(name, {}).get("read_by")
    if given is not None:
        return str(given)
    if name in LABELS:
        return "output only"
    names = {name, *_aliases().get(name, ())}
    pattern = re.compile(r"\.(?:" + "|".join(sorted(names)) + r")\b|[\"']" + name + r"[\"']")
    return ", ".join(r for r, text in _reader_sources().items() if pattern.search(text)) or "-"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


INTRO = """# Run spec reference

<!-- Generated by `python -m aihpc.runspec.reference > docs/run-spec.md` from the spec classes and
src/aihpc/runspec/data/fields.toml. Do not edit it by hand: tests/runspec/test_run_spec_doc.py fails
when it differs from what the code generates. -->

A run spec is one TOML file with the tables below; `aihpc estimate`, `search`, `goodput`,
`infer` and `train` read it (the shared contract, RUN_SPEC.md, fixes the field names). Examples:
[examples/](../examples/). An unknown table or field, a value of the wrong type or outside what is
allowed is answered with exit code 2 and one line naming the field, the value and what is
allowed; the *allowed* column quotes that line. *Read by* names the parts of aihpc whose code
reads the field (planner: estimate, search, goodput; trainer: `aihpc train`), found in their
source when this page was generated; "-" is a field that is accepted and checked but read by no
part yet.
"""

HEADINGS = {
    "model": "`[model]`: what is trained",
    "cluster": "`[cluster]`: where",
    "gpu_spec": "`[cluster.gpu_spec]`: a GPU part's figures",
    "vision": "`[model.vision]`: a vision-language model's encoder and projector",
    "multimodal": "`[multimodal]`: the images a vision-language run carries, and its choices",
    "parallel": "`[parallel]`: how (a field left out is searched by `aihpc search`)",
    "training": "`[training]`: numerics, kernels and the trainer's schedule",
    "checkpoint": "`[checkpoint]`: the trainer's checkpoints",
    "reliability": "`[reliability]`: failures and recovery, for the goodput model",
    "rl": "`[rl]`: an RL post-training step (GRPO, RLOO, PPO; docs/rl.md)",
    "rl.rollout": "`[rl.rollout]`: the rollout engines' layout",
    "inference": "`[inference]`: what `aihpc infer` prices (docs/inference.md)",
}


def render() -> str:
    """The whole page (Markdown)."""
    docs = field_docs()
    lines = [INTRO]
    for section, names in section_fields().items():
        lines += ["", f"## {HEADINGS[section]}", ""]
        lines += ["| field | type | default | allowed | read by | meaning |", "|---" * 6 + "|"]
        for name in names:
            doc = docs.get(section, {}).get(name, {}).get("doc", "")
            cells = (
                f"`{name}`",
                _type(section, name),
                _default(section, name),
                _allowed(section, name),
                _read_by(section, name),
                doc,
            )
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
