"""What an RL step spends beside the phase models' GPU work (data/overheads.toml, each figure a
published measurement of one component, its source named there):

- the rollout engine's host work per decode step (scheduling, input preparation, the sampled
  tokens' copy to the host, detokenisation, returned log-probs), which the GPU waits for: an
  RL framework drives its vLLM / SGLang engine one decode step per scheduler call;
- colocated: the engine's sleep after its rollout (its weights out to host memory, its KV cache
  freed), at the measured GiB per second, and its wake before the next one;
- the trainer's orchestration between phases (buffer sampling, preparing the batch for the
  log-prob pass and for training, data processing), on the training side's critical path;
- a ceiling on the training side: no faster than Megatron Core pre-trains the same model on the
  same GPU (published tokens per second per GPU), where a row names both; a row that names the
  MoE stack its run used (``moe_stack``: the token dispatcher, training.MOE_STACKS) bounds the
  runs on that stack, since the dispatcher, not the GPU, sets a small MoE's rate: Qwen3-30B-A3B
  on 16 H100 trained at 5,275 tokens/s/GPU with Megatron-Core's alltoall dispatcher and at
  8,960 after the same benchmark moved to HybridEP (data/overheads.toml).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from aihpc.runspec.cluster import ClusterSpec
from aihpc.runspec.model import ModelSpec
from aihpc.runspec.rl import RLSpec

__all__ = [
    "Overheads",
    "ceiling_rate",
    "engine_sleep_wake_s",
    "overheads",
    "training_ceiling_s",
]


@dataclass(frozen=True)
class Overheads:
    engine_step_s: float  # host time per decode step the GPU waits for
    sleep_GiBps: float  # engine memory put to sleep per second
    wake_s: float
    orchestration_s: float  # per RL step, on the training side
    # (model preset, gpu id) -> [(tokens / s / GPU, the run's moe_stack or None where unnamed)]
    ceilings: dict[tuple[str, str], list[tuple[float, str | None]]]
    sources: dict[str, str]


def _mean(x: Any) -> float:
    values = x if isinstance(x, list) else [x]
    return sum(float(v) for v in values) / len(values)


@cache
def overheads() -> Overheads:
    text = resources.files("aihpc.perf.rl").joinpath("data/overheads.toml").read_text()
    t = tomllib.loads(text)
    sleep = t["engine_sleep"]
    ceilings: dict[tuple[str, str], list[tuple[float, str | None]]] = {}
    sources = {k: t[k]["source"] for k in ("engine_step", "engine_sleep", "orchestration")}
    for row in t["training_ceiling"]:
        rate = (float(row["tokens_per_s_per_gpu"]), row.get("moe_stack"))
        ceilings.setdefault((row["model"], row["gpu"]), []).append(rate)
        stack = f" {row['moe_stack']}" if row.get("moe_stack") else ""
        sources[f"training_ceiling {row['model']} {row['gpu']}{stack}"] = row["source"]
    return Overheads(
        engine_step_s=float(t["engine_step"]["seconds"]),
        sleep_GiBps=float(sleep["freed_gib"]) / _mean(sleep["sleep_seconds"]),
        wake_s=float(sleep["wake_seconds"]),
        orchestration_s=sum(float(v) for v in t["orchestration"]["seconds"]),
        ceilings=ceilings,
        sources=sources,
    )


def engine_sleep_wake_s(cluster: ClusterSpec, rl: RLSpec) -> float:
    """Colocated: one sleep of the engine's share of each GPU (weights and KV cache) and one
    wake; 0 when the rollout engines have GPUs of their own."""
    if rl.placement != "colocated":
        return 0.0
    o = overheads()
    engine_gib = rl.rollout.gpu_memory_utilization * cluster.gpu.hbm_gib
    return engine_gib / o.sleep_GiBps + o.wake_s


def ceiling_rate(model: ModelSpec, cluster: ClusterSpec, moe_stack: str = "unknown") -> float:
    """Tokens per second per GPU Megatron Core is published to pre-train this model at on this
    GPU: the fastest row of the run's own MoE stack where one names it, else the fastest row of
    any stack (the loosest bound: a stack not measured, or not stated); 0 where no row names
    the model and the GPU."""
    rows = overheads().ceilings.get((model.name, cluster.gpu.id), [])
    same = [rate for rate, stack in rows if stack is not None and stack == moe_stack]
    return max(same or [rate for rate, _ in rows], default=0.0)


def training_ceiling_s(
    model: ModelSpec,
    cluster: ClusterSpec,
    tokens: float,
    gpus: int,
    moe_stack: str = "unknown",
) -> float:
    """The least seconds ``tokens`` can be trained on ``gpus`` GPUs: the published pre-training
    rate of this model on this GPU and MoE stack (``ceiling_rate``; 0 where none)."""
    rate = ceiling_rate(model, cluster, moe_stack)
    if rate <= 0 or gpus < 1:
        return 0.0
    return tokens / (rate * gpus)
