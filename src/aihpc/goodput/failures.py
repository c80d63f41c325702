"""Inputs of the goodput model: failure rates, checkpoint cost and recovery time.

Failure rates come from published root-cause counts (``data/reliability.toml``, every number
with its source): a component's rate per unit-hour is its count divided by the units x hours it
was observed over, and the job's rate is the sum over components of that rate x the job's units
(GPUs for per-GPU parts, nodes for per-node parts). Failures are taken as independent and
exponential (constant hazard), the standard assumption of Young (1974) and Daly (2006).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from aihpc.runspec.cluster import ClusterSpec
from aihpc.runspec.errors import SpecError
from aihpc.runspec.reliability import ReliabilitySpec
from aihpc.runspec.runspec import RunSpec

__all__ = [
    "CheckpointCost",
    "Component",
    "FailureModel",
    "RecoveryCost",
    "checkpoint_cost",
    "checkpoint_strategy",
    "components",
    "failure_model",
    "recovery_cost",
    "reliability_defaults",
]

HOUR_S = 3600.0
DAY_S = 86400.0
GB = 1e9


@cache
def reliability_defaults() -> dict[str, Any]:
    """The data file ``goodput/data/reliability.toml`` as a dict."""
    text = resources.files("aihpc.goodput").joinpath("data/reliability.toml").read_text()
    return tomllib.loads(text)


@dataclass(frozen=True)
class Component:
    """One root cause: its published count and the rate per unit-hour derived from it."""

    name: str
    count: int
    scale: str  # "gpu" | "node": what the rate grows with
    category: str
    source: str
    rate_per_unit_hour: float


@cache
def components() -> dict[str, Component]:
    """Default per-component rates: count / (units x hours) of the observed population."""
    data = reliability_defaults()
    exp = data["exposure"]["llama3"]
    hours = exp["days"] * 24.0
    units = {"gpu": exp["num_gpus"], "node": exp["num_nodes"]}
    out = {}
    for name, c in data["components"].items():
        rate = c["count"] / (units[c["scale"]] * hours)
        out[name] = Component(name, c["count"], c["scale"], c["category"], c["source"], rate)
    return out


@dataclass(frozen=True)
class FailureModel:
    """Failure process of one job: unexpected failures and planned interruptions, per second."""

    num_gpus: int
    num_nodes: int
    rates_per_hour: dict[str, float]  # job-level unexpected failures per hour, by component
    planned_per_day: float
    source: str

    @property
    def failure_rate_per_s(self) -> float:
        return sum(self.rates_per_hour.values()) / HOUR_S

    @property
    def mtbf_s(self) -> float:
        """Mean time between unexpected failures of the whole job."""
        rate = self.failure_rate_per_s
        return 1.0 / rate if rate > 0 else float("inf")

    @property
    def planned_rate_per_s(self) -> float:
        return self.planned_per_day / DAY_S

    def by_category(self) -> dict[str, float]:
        """Failures per hour grouped by category (GPU, software, network, host)."""
        cats: dict[str, float] = {}
        table = components()
        for name, rate in self.rates_per_hour.items():
            cat = table[name].category if name in table else name
            cats[cat] = cats.get(cat, 0.0) + rate
        return cats


def failure_model(cluster: ClusterSpec, rel: ReliabilitySpec) -> FailureModel:
    """Job failure rates at ``cluster.num_gpus``: per-GPU parts x GPUs + per-node parts x nodes."""
    table = components()
    overrides = dict(rel.failure_rates or {})
    for name in overrides:
        if name not in table:
            raise SpecError(
                f"reliability.failure_rates.{name}",
                overrides[name],
                "unknown component; allowed: " + ", ".join(sorted(table)),
            )
    units = {"gpu": cluster.num_gpus, "node": cluster.num_nodes}
    scale = 1.0 if rel.failure_rate_scale is None else rel.failure_rate_scale
    rates = {
        name: scale * overrides.get(name, c.rate_per_unit_hour) * units[c.scale]
        for name, c in table.items()
    }
    source = "Llama 3 Table 5 per-component rates"
    if overrides or rel.failure_rate_scale is not None:
        source += " with [reliability] overrides"
    if rel.mtbf_s is not None:  # the user's MTBF replaces the sum, keeping the mix of causes
        total = sum(rates.values())
        target = HOUR_S / rel.mtbf_s
        rates = {
            k: (v / total * target if total > 0 else target / len(rates)) for k, v in rates.items()
        }
        source = "[reliability] mtbf_s"
    planned = rel.planned_interruptions_per_day
    if planned is None:
        planned = reliability_defaults()["planned"]["per_day"]
    return FailureModel(cluster.num_gpus, cluster.num_nodes, rates, planned, source)


def checkpoint_strategy(spec: RunSpec) -> str:
    """[reliability] checkpoint_strategy, else async when [checkpoint] async_save, else sync."""
    if spec.reliability.checkpoint_strategy is not None:
        return spec.reliability.checkpoint_strategy
    return "async" if spec.checkpoint.async_save else "sync"


@dataclass(frozen=True)
class CheckpointCost:
    """What one save costs: ``blocking_s`` pauses training; ``persist_s`` runs in the background
    until the save is durable (a failure before then rolls back to the previous save)."""

    strategy: str
    checkpoint_bytes: float
    write_bw_GBps: float
    read_bw_GBps: float
    bw_source: str
    blocking_s: float
    persist_s: float
    load_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "bytes": self.checkpoint_bytes,
            "write_bw_GBps": self.write_bw_GBps,
            "read_bw_GBps": self.read_bw_GBps,
            "bw_source": self.bw_source,
            "blocking_s": self.blocking_s,
            "persist_s": self.persist_s,
            "load_s": self.load_s,
        }


def _storage_bw_GBps(cluster: ClusterSpec) -> tuple[float, float, str]:
    st = reliability_defaults()["storage"]
    default = min(st["per_node_bw_GBps"] * cluster.num_nodes, st["aggregate_cap_GBps"])
    write, read = cluster.storage_write_bw_GBps, cluster.storage_read_bw_GBps
    parts = []
    if write is None or read is None:
        parts.append(
            f"default: {st['per_node_bw_GBps']:.2f} GB/s per node x {cluster.num_nodes} "
            f"nodes, cap {st['aggregate_cap_GBps']:.0f} GB/s (Llama 3 Tectonic)"
        )
    if write is not None or read is not None:
        parts.append("[cluster] storage_*_bw_GBps")
    return (write or default), (read or write or default), "; ".join(parts)


def checkpoint_cost(spec: RunSpec, checkpoint_bytes: float) -> CheckpointCost:
    """Blocking, background and load time of one checkpoint of ``checkpoint_bytes`` bytes.

    sync: write everything to storage while training waits: overhead + S / write_bw.
    async: copy this GPU's shard to pinned host memory (overhead + S/N / host_bw), then persist
      S / write_bw in the background (DCP ``async_save``; Megatron async; Llama 3).
    in_memory: same staging, then replicate the shard to a peer node over the scale-out NIC
      (S/N / scale_out_bw); restart reads it back from the peer (Gemini, SOSP'23; NVRx local
      checkpoints) instead of from storage.
    """
    rel, cluster = spec.reliability, spec.cluster
    strategy = checkpoint_strategy(spec)
    st = reliability_defaults()["staging"]
    overhead = st["overhead_s"] if rel.checkpoint_overhead_s is None else rel.checkpoint_overhead_s
    host_bw = rel.host_copy_bw_GBps or st["host_copy_bw_GBps"]
    write_bw, read_bw, bw_source = _storage_bw_GBps(cluster)
    shard = checkpoint_bytes / cluster.num_gpus
    stage_s = overhead + shard / (host_bw * GB)
    if strategy == "sync":
        blocking, persist = overhead + checkpoint_bytes / (write_bw * GB), 0.0
        load = checkpoint_bytes / (read_bw * GB)
    elif strategy == "async":
        blocking, persist = stage_s, checkpoint_bytes / (write_bw * GB)
        load = checkpoint_bytes / (read_bw * GB)
    else:  # in_memory
        peer_bw = cluster.scale_out_bw_GBps
        blocking, persist = stage_s, shard / (peer_bw * GB)
        load = shard / (peer_bw * GB)
        bw_source = f"peer copy over the scale-out NIC, {peer_bw:g} GB/s per GPU"
        write_bw = read_bw = peer_bw * cluster.num_gpus
    if rel.checkpoint_blocking_s is not None:
        blocking = rel.checkpoint_blocking_s
    if rel.checkpoint_persist_s is not None:
        persist = rel.checkpoint_persist_s
    if rel.load_time_s is not None:
        load = rel.load_time_s
    return CheckpointCost(
        strategy, checkpoint_bytes, write_bw, read_bw, bw_source, blocking, persist, load
    )


@dataclass(frozen=True)
class RecoveryCost:
    """Time from a failure until training runs again."""

    detection_s: float
    restart_s: float  # rescheduling onto healthy nodes, relaunch, framework initialisation
    load_s: float
    source: str

    @property
    def total_s(self) -> float:
        return self.detection_s + self.restart_s + self.load_s

    def to_json(self) -> dict[str, Any]:
        return {
            "detection_s": self.detection_s,
            "restart_s": self.restart_s,
            "load_s": self.load_s,
            "total_s": self.total_s,
            "source": self.source,
        }


def recovery_cost(rel: ReliabilitySpec, load_s: float) -> RecoveryCost:
    d = reliability_defaults()["recovery"]
    detection = d["detection_time_s"] if rel.detection_time_s is None else rel.detection_time_s
    restart = d["restart_time_s"] if rel.restart_time_s is None else rel.restart_time_s
    given = rel.detection_time_s is not None or rel.restart_time_s is not None
    source = "[reliability] overrides" if given else d["source"]
    return RecoveryCost(detection, restart, load_s, source)
