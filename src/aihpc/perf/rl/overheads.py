"""What an RL step spends beside the phase models' GPU work (data/overheads.toml, each figure a
published measurement of one component, its source named there):

- the rollout engine's host work per decode step (scheduling, input preparation, the sampled
  tokens' copy to the host, detokenisation, returned log-probs), which the GPU waits for: an
  RL framework drives its vLLM / SGLang engine one decode step per scheduler call; measured on
  an x86 host, it is scaled per host kind by the time one PyTorch eager call takes there
  (runspec/data/host_cpus.toml ``[[host_cpu]]``: a Grace host, GB200's, took 2.75x a DGX H100's
  Xeon);
- colocated: the host-copy rates of the switch between training and generation (pageable
  copies per host kind; pinned copies at the GPU's host link), which perf/rl/switch.py prices
  on the bytes each call moves;
- the trainer's orchestration between phases (buffer sampling, preparing the batch for the
  log-prob pass and for training, data processing), on the training side's critical path;
- a ceiling on the training side: no faster than Megatron Core pre-trains the same model on the
  same GPU (published tokens per second per GPU), where a row names both; a row that names the
  MoE stack its run used (``moe_stack``: the token dispatcher, training.MOE_STACKS) bounds the
  runs on that stack, since the dispatcher, not the GPU, sets a small MoE's rate: Qwen3-30B-A3B
  on 16 H100 trained at 5,275 tokens/s/GPU with Megatron-Core's alltoall dispatcher and at
  8,960 after the same benchmark moved to HybridEP (data/overheads.toml). A row measured with
  dropped tokens (``token_drop``) bounds a dropless run only on its own stack and only where no
  dropless row of that stack exists: GB200's alltoall rates are published token-dropping only.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from aihpc.runspec.cluster import ClusterSpec
from aihpc.runspec.errors import SpecError
from aihpc.runspec.host_cpu import host_cpu_ratio, host_cpu_rows
from aihpc.runspec.model import ModelSpec

__all__ = [
    "Ceiling",
    "HostRates",
    "Overheads",
    "ceiling_rate",
    "engine_step_s",
    "host_rates",
    "overheads",
    "training_ceiling_s",
]


@dataclass(frozen=True)
class Ceiling:
    """One published pre-training rate (a ``[[training_ceiling]]`` row)."""

    rate: float  # tokens per second per GPU
    stack: str | None  # the run's moe_stack, None where the row names none
    token_drop: bool = False  # the run dropped tokens (capacity-bounded experts)


@dataclass(frozen=True)
class Overheads:
    engine_step_s: float  # host time per decode step the GPU waits for, on the reference host
    # gpu id -> (pageable device-to-host, pageable host-to-device) GB/s of its host
    pageable_GBps: dict[str, tuple[float, float]]
    orchestration_s: float  # per RL step, on the training side
    # (model preset, gpu id) -> the published pre-training rates of that model on that GPU
    ceilings: dict[tuple[str, str], list[Ceiling]]
    sources: dict[str, str]


def _mean(x: Any) -> float:
    values = x if isinstance(x, list) else [x]
    return sum(float(v) for v in values) / len(values)


@cache
def overheads() -> Overheads:
    text = resources.files("aihpc.perf.rl").joinpath("data/overheads.toml").read_text()
    t = tomllib.loads(text)
    pageable: dict[str, tuple[float, float]] = {}
    for row in t["host_copy"]:
        rates = (_mean(row["pageable_d2h_GBps"]), _mean(row["pageable_h2d_GBps"]))
        pageable.update({gpu: rates for gpu in row["gpus"]})
    ceilings: dict[tuple[str, str], list[Ceiling]] = {}
    sources = {k: t[k]["source"] for k in ("engine_step", "orchestration")}
    sources.update({f"host_copy {row['host']}": row["source"] for row in t["host_copy"]})
    sources.update({f"host_cpu {row['host']}": row["source"] for row in host_cpu_rows()})
    for row in t["training_ceiling"]:
        drop = bool(row.get("token_drop", False))
        rate = Ceiling(float(row["tokens_per_s_per_gpu"]), row.get("moe_stack"), drop)
        ceilings.setdefault((row["model"], row["gpu"]), []).append(rate)
        stack = f" {row['moe_stack']}" if row.get("moe_stack") else ""
        key = f"training_ceiling {row['model']} {row['gpu']}{stack}"
        key += f" token-drop {rate.rate:g}" if drop else ""
        sources[key] = row["source"]
    return Overheads(
        engine_step_s=float(t["engine_step"]["seconds"]),
        pageable_GBps=pageable,
        orchestration_s=sum(float(v) for v in t["orchestration"]["seconds"]),
        ceilings=ceilings,
        sources=sources,
    )


def engine_step_s(cluster: ClusterSpec) -> float:
    """The serving engine's host time per decode step on this cluster's GPUs' host: [engine_step]
    (measured on an x86 host) scaled by the host's [[host_cpu]] eager-call time over the
    reference host's; a GPU in no [[host_cpu]] row pays [engine_step] as it stands."""
    return overheads().engine_step_s * host_cpu_ratio(cluster.gpu.id)


@dataclass(frozen=True)
class HostRates:
    """GB/s of each host-copy kind between one GPU and its host, per direction."""

    pinned_d2h: float
    pinned_h2d: float
    pageable_d2h: float  # into a fresh pageable allocation (tensor.to("cpu"))
    pageable_h2d: float  # from pageable memory (tensor.to("cuda"))
    measured_pageable: bool  # False: no [[host_copy]] row names the GPU (pinned rate used)


def host_rates(cluster: ClusterSpec) -> HostRates:
    """The GPU's host-copy rates: pinned at its ``host_link_GBps`` (both directions), pageable
    as the ``[[host_copy]]`` row naming the GPU measured (never above the pinned rate), or at
    the pinned rate where none does (a lower bound on the copy's time)."""
    link = cluster.gpu.host_link_GBps
    if link is None:
        raise SpecError(
            "cluster.gpu",
            cluster.gpu.id,
            "has no host_link_GBps (GPU <-> host copy bandwidth) to price the colocated "
            "offload: set it in [cluster.gpu_spec]",
        )
    measured = overheads().pageable_GBps.get(cluster.gpu.id)
    d2h, h2d = measured or (link, link)
    return HostRates(link, link, min(d2h, link), min(h2d, link), measured is not None)


def ceiling_rate(model: ModelSpec, cluster: ClusterSpec, moe_stack: str = "unknown") -> float:
    """Tokens per second per GPU Megatron Core is published to pre-train this model at on this
    GPU, for a dropless run (every RL framework's default): the fastest dropless row of the run's
    own MoE stack; where that stack was measured only with dropped tokens, the fastest of those
    (a capacity-bounded run does no more work and no host sync, so its rate is at least the
    stack's dropless one: a looser bound, never a wrong one); where no row names the stack (or
    the run states none), the fastest dropless row of any stack, the loosest bound. A
    token-dropping row never stands for another stack. 0 where no row names the model and GPU."""
    rows = overheads().ceilings.get((model.name, cluster.gpu.id), [])
    same = [c for c in rows if c.stack is not None and c.stack == moe_stack]
    dropless = [c.rate for c in same if not c.token_drop]
    chosen = dropless or [c.rate for c in same]
    if not chosen:
        chosen = [c.rate for c in rows if not c.token_drop] or [c.rate for c in rows]
    return max(chosen, default=0.0)


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
