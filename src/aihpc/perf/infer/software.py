"""Serving-engine software facts (data/engines.toml): what an engine of a given version does
that changes a step's cost: CUDA graphs for decode (without them, a Python-driven engine's step
is no faster than its host issues the step's kernels), grouped-query decode kernels, the
two-batch overlap of prefill communication with compute and the SMs that communication holds. An
``[inference]`` spec or a published row names its ``engine``; ``default`` is a current engine
(the model's assumptions before these facts were separate).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields, replace
from functools import cache
from importlib import resources
from typing import Any

from aihpc.runspec.errors import SpecError

__all__ = [
    "DEFAULT_SOFTWARE",
    "SOFTWARE_FACTS",
    "Software",
    "engine_names",
    "gpu_sms",
    "software_for",
]


@dataclass(frozen=True)
class Software:
    name: str = "default"
    cuda_graphs: bool = True
    gqa_grouped_decode: bool = True
    two_batch_overlap: bool = False
    comm_sms: int = 0
    # without CUDA graphs, who issues each kernel of a step: PyTorch ops called from Python (vLLM,
    # SGLang: ModelParams.host_eager_op_s a kernel, which the GPU waits for where its kernels are
    # shorter) or a C++ runtime (TensorRT-LLM: a launch, already the kernel's launch gap)
    python_host: bool = True

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


DEFAULT_SOFTWARE = Software()
SOFTWARE_FACTS = (
    "cuda_graphs",
    "gqa_grouped_decode",
    "two_batch_overlap",
    "comm_sms",
    "python_host",
)


@cache
def _table() -> dict[str, Any]:
    text = resources.files("aihpc.perf.infer").joinpath("data/engines.toml").read_text()
    return tomllib.loads(text)


def engine_names() -> list[str]:
    return sorted(_table()["engine"])


def gpu_sms(gpu_id: str) -> int | None:
    """Streaming multiprocessors of a catalog part (None where the table does not list it)."""
    return _table()["sms"].get(gpu_id)


def software_for(engine: str = "default", **overrides: Any) -> Software:
    """The facts of ``engine`` (a name in data/engines.toml), with ``overrides`` of single facts
    (a run's published flags); a bad name or value is one SpecError naming it."""
    table = _table()["engine"]
    if engine not in table:
        raise SpecError("inference.engine", engine, "one of " + ", ".join(engine_names()))
    base = Software(engine, **{k: table[engine][k] for k in SOFTWARE_FACTS})
    for key, value in overrides.items():
        if key not in SOFTWARE_FACTS:
            raise SpecError(f"inference.{key}", value, "one of " + ", ".join(SOFTWARE_FACTS))
        if key == "comm_sms":
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SpecError("inference.comm_sms", value, "a whole number >= 0")
        elif not isinstance(value, bool):
            raise SpecError(f"inference.{key}", value, "true or false")
    return replace(base, **overrides)
