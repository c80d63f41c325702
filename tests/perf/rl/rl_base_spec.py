"""The RL spec the perf/rl tests start from: GRPO for Qwen3-30B-A3B on 32 H100, experts over
8 GPUs, rollout engines at tp 2 (each test changes what it checks)."""

from __future__ import annotations

import copy
from typing import Any

from aihpc.runspec import RunSpec, runspec_from_dict

BASE: dict[str, Any] = {
    "model": {"preset": "qwen3-30b-a3b"},
    "cluster": {"gpu": "h100-sxm", "num_gpus": 32},
    "parallel": {"ep": 8, "global_batch_size": 512},
    "rl": {
        "prompts_per_step": 64,
        "samples_per_prompt": 32,
        "prompt_len": 200,
        "response_len": 2000,
        "max_response_len": 3800,
        "rollout": {"tp": 2},
    },
}


def base_spec(model: str | None = None, gpu: str | None = None, **rl: Any) -> RunSpec:
    """BASE with the ``[rl]`` fields given replaced (and the model preset, the GPU)."""
    data = copy.deepcopy(BASE)
    data["rl"].update(rl)
    if model:
        data["model"]["preset"] = model
    if gpu:
        data["cluster"]["gpu"] = gpu
    return runspec_from_dict(data)
