"""Recovery strategies priced side by side: storage-only, async, in-memory peer, in-process restart.

Each strategy is a set of run facts: what a save blocks (``C``) and how long until it is safe
(``W``), and, for each kind of failure, the path that recovers it (detection, restart, restore)
and how far it rolls back. The kinds (``data/recovery_paths.toml``) are what the failure broke:

    exception       one rank raised; the node is fine          (Llama 3 Table 5 software rows)
    hang            a collective never completes                (NCCL watchdog row)
    node            the node leaves the job                     (GPU, network, host rows)
    node_and_peer   a node and the peer that holds its replica are lost together

The strategies are cumulative:

    sync       storage saves block; every failure relaunches and loads from storage
    async      saves stage to host memory and persist in the background (DCP async_save)
    in_memory  + a replica of every rank's snapshot on a peer node (Gemini, SOSP'23); a relaunch
               restores from peer memory; only node_and_peer falls back to storage, and loses
               the work since the last *durable storage* save as well
    inprocess  + exceptions and hangs restart inside the processes (NVRx inprocess.Wrapper) and
               restore from the rank's own host memory; node losses go the in_memory way

ETTR is exact for Poisson failures with a *mix* of recovery times. Between durable saves (the
renewal argument of ``ettr.py``), a failure of kind k happens with probability p_k and needs
D_k = R_k + L' of failure-free time; a failure during it starts a new recovery of a new kind, so
the time from a failure to the next durable save is T2 = (1 − q)/(λq), q = Σ p_k e^{−λ D_k}.
With one kind this is Daly's (e^{λ(R+L')} − 1)/λ. Then T1 = (1 − e^{−λL})/(λq) and
ETTR = τ / T1 / (1 + λp·P). The storage fallback's extra rollback is priced as recovery time
that must be re-run (exposed to failures), a first-order term inside the exact expression.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cache
from importlib import resources
from typing import Any

from aihpc.goodput.ettr import daly_interval_s, maximise_on_log_scale, young_interval_s
from aihpc.goodput.failures import (
    DAY_S,
    GB,
    CheckpointCost,
    checkpoint_cost,
    failure_model,
    reliability_defaults,
)
from aihpc.runspec.errors import SpecError
from aihpc.runspec.runspec import RunSpec

__all__ = [
    "DEFAULT_GPU_COUNTS",
    "KINDS",
    "STRATEGIES",
    "Fact",
    "PathCost",
    "StrategyResult",
    "compare_strategies",
    "figures",
    "measured_figures",
    "mixed_ettr",
    "mixes_sources",
    "recovery_path_defaults",
    "strategy_result",
]

KINDS = ("exception", "hang", "node", "node_and_peer")
STRATEGIES = {
    "sync": "storage-only (sync)",
    "async": "async storage",
    "in_memory": "in-memory peer",
    "inprocess": "in-process restart",
}
DEFAULT_GPU_COUNTS = (16384, 100000)
# measured recovery_time.json paths -> the figures they replace (see docs/goodput.md §8)
MEASURED_KEYS = {
    "agent_storage": ("detection.exception_agent", "detection.node", "restart.agent_storage"),
    "agent_peer": (None, None, "restart.agent_peer"),
    "inprocess_exception": ("detection.exception_inprocess", None, "restart.inprocess_exception"),
    "inprocess_hang": ("detection.hang_inprocess", None, "restart.inprocess_hang"),
}


@cache
def recovery_path_defaults() -> dict[str, Any]:
    """The data file ``goodput/data/recovery_paths.toml`` as a dict."""
    text = resources.files("aihpc.goodput").joinpath("data/recovery_paths.toml").read_text()
    return tomllib.loads(text)


@dataclass(frozen=True)
class Fact:
    """One figure and where it came from: "published: ...", "assumption: ...", "measured: ..."
    or "[reliability] ..." (the run spec's override)."""

    value: float
    source: str


def figures() -> dict[str, Fact]:
    """Published default detection and restart figures, keyed ``detection.x`` / ``restart.x``."""
    data = recovery_path_defaults()
    out = {}
    for group in ("detection", "restart"):
        for name, f in data[group].items():
            src = f["source"]
            label = src if src.startswith("assumption") else "published: " + src
            out[f"{group}.{name}"] = Fact(float(f["value"]), label)
    for group in ("detection", "restart"):  # "as X": X's label, since the figure is X's
        for name, f in data[group].items():
            if "same_as" in f:
                target = out[f"{group}.{f['same_as']}"]
                kind = target.source.partition(": ")[0]
                out[f"{group}.{name}"] = Fact(
                    out[f"{group}.{name}"].value, f"{kind}: as {f['same_as']}; {f['source']}"
                )
    return out


def _measured_number(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise SpecError(f"--measured {where}", value, "expected a number of seconds ≥ 0")
    return float(value)


def measured_figures(doc: Mapping[str, Any], label: str) -> dict[str, Fact]:
    """Figures that a recovery_time.json replaces: ``paths.<path>.detection_s`` and
    ``.restart_s`` for the paths in MEASURED_KEYS, or, in a file without ``paths``, the
    agent-restart medians ``median.kill`` and ``median.hang.detection_s``. Restore times are
    not taken: they are computed from the checkpoint bytes of the run being priced."""
    out: dict[str, Fact] = {}
    paths = doc.get("paths")
    prefix = {path: f"paths.{path}" for path in MEASURED_KEYS}
    if paths is None:  # the first recovery benchmark: agent restarts only
        med = doc.get("median") or {}
        if not isinstance(med, Mapping) or not isinstance(med.get("hang", {}), Mapping):
            raise SpecError("--measured median", med, "expected an object of recovery medians")
        paths = {"agent_storage": med["kill"]} if "kill" in med else {}
        prefix["agent_storage"] = "median.kill"
        if "hang" in med and "detection_s" in med["hang"]:
            v = _measured_number("median.hang.detection_s", med["hang"]["detection_s"])
            out["detection.hang_agent"] = Fact(v, f"measured: {label} median.hang.detection_s")
    if not isinstance(paths, Mapping):
        raise SpecError("--measured paths", paths, "expected an object of recovery paths")
    for path, (det_exc, det_node, restart) in MEASURED_KEYS.items():
        row = paths.get(path)
        if not isinstance(row, Mapping):
            continue
        for key, field in ((det_exc, "detection_s"), (det_node, "detection_s"), (restart, None)):
            if key is None:
                continue
            if field is None:  # restart: respawn + init, or teardown + rebuild
                field = "restart_s"
            if field in row:
                where = f"{prefix[path]}.{field}"
                out[key] = Fact(_measured_number(where, row[field]), f"measured: {label} {where}")
    return out


@dataclass(frozen=True)
class PathCost:
    """How one kind of failure is recovered under one strategy."""

    path: str  # agent_storage | agent_peer | inprocess_exception | inprocess_hang
    rate_per_s: float
    detection: Fact
    restart: Fact
    restore_s: float
    restore_from: str  # storage | peer memory | own host memory

    @property
    def recovery_s(self) -> float:
        return self.detection.value + self.restart.value + self.restore_s


def _paths(strategy: str) -> dict[str, tuple[str, str, str]]:
    """kind -> (path, detection key, restore tier) under ``strategy``."""
    agent = {
        "exception": ("agent_storage", "detection.exception_agent", "storage"),
        "hang": ("agent_storage", "detection.hang_agent", "storage"),
        "node": ("agent_storage", "detection.node", "storage"),
        "node_and_peer": ("agent_storage", "detection.node", "storage"),
    }
    if strategy in ("sync", "async"):
        return agent
    peer = {k: ("agent_peer", d, "peer") for k, (_, d, _) in agent.items() if k != "node_and_peer"}
    out = {**agent, **peer}
    if strategy == "inprocess":
        out["exception"] = ("inprocess_exception", "detection.exception_inprocess", "own")
        out["hang"] = ("inprocess_hang", "detection.hang_inprocess", "own")
    return out


def mixed_ettr(
    interval_s: float,
    blocking_s: float,
    persist_s: float,
    recoveries: list[tuple[float, float]],
    planned_rate_per_s: float = 0.0,
    planned_cost_s: float = 0.0,
    failures_during_recovery: bool = True,
) -> float:
    """Exact ETTR with failures of several kinds: ``recoveries`` is [(rate per s, R_k)].

    See the module doc; with one kind it equals ``goodput.ettr`` (tested)."""
    lam = sum(r for r, _ in recoveries)
    planned = 1.0 + planned_rate_per_s * planned_cost_s
    if lam == 0.0:
        return interval_s / (interval_s + blocking_s) / planned
    L = interval_s + blocking_s
    Lp = L + persist_s
    try:
        if failures_during_recovery:
            q = sum(r / lam * math.exp(-lam * (R + Lp)) for r, R in recoveries)
            t1 = -math.expm1(-lam * L) / (lam * q) if q > 0 else math.inf
        else:  # T2 = R̄ e^{λL'} + (e^{λL'} − 1)/λ, R̄ the mean recovery
            r_mean = sum(r / lam * R for r, R in recoveries)
            t2 = r_mean * math.exp(lam * Lp) + math.expm1(lam * Lp) / lam
            t1 = -math.expm1(-lam * L) * (1.0 / lam + t2)
    except OverflowError:
        return 0.0
    return interval_s / t1 / planned


@dataclass(frozen=True)
class StrategyResult:
    """ETTR of one strategy at one GPU count, with the facts it came from."""

    strategy: str
    num_gpus: int
    mtbf_s: float
    blocking_s: float
    persist_s: float  # until the save is safe: peer copy (memory tiers) or storage persist
    storage_persist_s: float  # until a storage copy is durable (the fallback's)
    paths: dict[str, PathCost]
    planned_rate_per_s: float
    planned_cost_s: float
    failures_during_recovery: bool
    interval_s: float
    ettr: float

    def storage_extra_rollback_s(self, interval_s: float) -> float:
        """Work between the last durable storage save and the last snapshot, lost only by
        failures that fall back to storage under a memory tier. Storage persists from the staged
        snapshot as often as it keeps up: every ⌈W_s/(τ+C)⌉ snapshots."""
        if self.strategy in ("sync", "async"):
            return 0.0
        period = interval_s + self.blocking_s
        every = max(1, math.ceil(self.storage_persist_s / period - 1e-9))
        return (every - 1) * period / 2 + max(self.storage_persist_s - self.persist_s, 0.0)

    def recoveries(self, interval_s: float) -> list[tuple[float, float]]:
        extra = self.storage_extra_rollback_s(interval_s)
        return [
            (c.rate_per_s, c.recovery_s + (extra if c.restore_from == "storage" else 0.0))
            for c in self.paths.values()
        ]

    def ettr_at(self, interval_s: float) -> float:
        return mixed_ettr(
            interval_s,
            self.blocking_s,
            self.persist_s,
            self.recoveries(interval_s),
            self.planned_rate_per_s,
            self.planned_cost_s,
            self.failures_during_recovery,
        )

    def lost_time(self) -> dict[str, float]:
        """1 − ETTR split in proportion to first-order terms: saves C/(τ+C); lost work
        Σλ_k((τ+C)/2 + W + storage rollback); detection, restart, restore Σλ_k x each; planned."""
        tau, extra = self.interval_s, self.storage_extra_rollback_s(self.interval_s)
        raw = dict.fromkeys(("checkpoint", "lost_work", "detection", "restart", "restore"), 0.0)
        raw["checkpoint"] = self.blocking_s / (tau + self.blocking_s)
        for c in self.paths.values():
            rollback = (tau + self.blocking_s) / 2 + self.persist_s
            rollback += extra if c.restore_from == "storage" else 0.0
            raw["lost_work"] += c.rate_per_s * rollback
            raw["detection"] += c.rate_per_s * c.detection.value
            raw["restart"] += c.rate_per_s * c.restart.value
            raw["restore"] += c.rate_per_s * c.restore_s
        raw["planned"] = self.planned_rate_per_s * self.planned_cost_s
        total, lost = sum(raw.values()), 1.0 - self.ettr
        return {k: (v / total * lost if total > 0 else 0.0) for k, v in raw.items()}

    def to_json(self) -> dict[str, Any]:
        lam = sum(c.rate_per_s for c in self.paths.values())
        return {
            "strategy": self.strategy,
            "label": STRATEGIES[self.strategy],
            "num_gpus": self.num_gpus,
            "mtbf_s": self.mtbf_s,
            "ettr": self.ettr,
            "checkpoint_interval_s": self.interval_s,
            "young_interval_s": young_interval_s(self.blocking_s, self.mtbf_s),
            "daly_interval_s": daly_interval_s(self.blocking_s, self.mtbf_s),
            "blocking_s": self.blocking_s,
            "persist_s": self.persist_s,
            "storage_persist_s": self.storage_persist_s,
            "mean_recovery_s": sum(c.rate_per_s * c.recovery_s for c in self.paths.values()) / lam
            if lam
            else 0.0,
            "lost_time_fraction": self.lost_time(),
            "paths": {
                kind: {
                    "path": c.path,
                    "failures_per_day": c.rate_per_s * DAY_S,
                    "detection_s": c.detection.value,
                    "detection_source": c.detection.source,
                    "restart_s": c.restart.value,
                    "restart_source": c.restart.source,
                    "restore_s": c.restore_s,
                    "restore_from": c.restore_from,
                }
                for kind, c in self.paths.items()
            },
        }


def _base_facts(spec: RunSpec, measured: Mapping[str, Fact] | None) -> dict[str, Fact]:
    """Published figures, then [reliability] overrides of the agent path, then measured ones."""
    facts = figures()
    rel = spec.reliability
    if rel.detection_time_s is not None:
        for key in ("detection.exception_agent", "detection.node"):
            facts[key] = Fact(rel.detection_time_s, "[reliability] detection_time_s")
    if rel.restart_time_s is not None:
        for key in ("restart.agent_storage", "restart.agent_peer"):
            facts[key] = Fact(rel.restart_time_s, "[reliability] restart_time_s")
    facts.update(measured or {})
    # a figure given "as" another follows it when that one was replaced and it was not
    data = recovery_path_defaults()
    published = figures()
    for group in ("detection", "restart"):
        for name, f in data[group].items():
            if "same_as" not in f:
                continue
            key, target = f"{group}.{name}", f"{group}.{f['same_as']}"
            if facts[key] == published[key] and facts[target] != published[target]:
                t = facts[target]
                facts[key] = Fact(t.value, f"as {target}: {t.source}")
    return facts


def mixes_sources(results: Mapping[str, StrategyResult]) -> bool:
    """True when the restart figures of one comparison come from both measurements and
    publications: a 2-rank measurement next to an at-scale figure does not rank strategies."""
    measured = {"measured:" in c.restart.source for r in results.values() for c in r.paths.values()}
    return measured == {True, False}


def _kind_rates_per_s(spec: RunSpec, pair_loss: float) -> dict[str, float]:
    """Failures per second of each kind; ``pair_loss`` of node losses take the peer too."""
    kinds = recovery_path_defaults()["kinds"]
    fm = failure_model(spec.cluster, spec.reliability)
    rates = dict.fromkeys(KINDS, 0.0)
    for name, per_hour in fm.rates_per_hour.items():
        rates[kinds[name]] += per_hour / 3600.0
    node = rates["node"]
    rates["node"], rates["node_and_peer"] = node * (1 - pair_loss), node * pair_loss
    return rates


def _check_fraction(value: float) -> None:
    if isinstance(value, bool) or not (0.0 <= value <= 1.0):
        raise SpecError("--correlated-loss", value, "must be a fraction in [0, 1]")


def _tiers(spec: RunSpec, checkpoint_bytes: float) -> tuple[dict[str, CheckpointCost], dict]:
    """Save cost of each checkpoint kind, and restore time from each tier: storage (S/read_bw or
    [reliability] load_time_s), a peer's memory ((S/N)/scale_out_bw), own host memory
    ((S/N)/host_copy_bw)."""

    def cost(s: str, **rel_fields: Any) -> CheckpointCost:
        rel = replace(spec.reliability, checkpoint_strategy=s, **rel_fields)
        return checkpoint_cost(replace(spec, reliability=rel), checkpoint_bytes)

    saves = {s: cost(s) for s in ("sync", "async", "in_memory")}
    staging = reliability_defaults()["staging"]
    host_bw = spec.reliability.host_copy_bw_GBps or staging["host_copy_bw_GBps"]
    restore = {
        "storage": saves["async"].load_s,
        "peer": cost("in_memory", load_time_s=None).load_s,  # load_time_s is the storage load
        "own": checkpoint_bytes / spec.cluster.num_gpus / (host_bw * GB),
    }
    return saves, restore


def strategy_result(
    spec: RunSpec,
    strategy: str,
    measured: Mapping[str, Fact] | None = None,
    correlated_loss_fraction: float | None = None,
    checkpoint_bytes: float | None = None,
) -> StrategyResult:
    """``strategy`` on ``spec`` at its optimal checkpoint interval (exact, continuous)."""
    if strategy not in STRATEGIES:
        raise SpecError("--strategy", strategy, "allowed: " + " | ".join(STRATEGIES))
    if checkpoint_bytes is None:
        from aihpc.perf.step.memory import checkpoint_bytes as _ckpt_bytes

        checkpoint_bytes = _ckpt_bytes(spec.model, spec.training)
    corr = correlated_loss_fraction
    if corr is None:
        corr = recovery_path_defaults()["peer"]["correlated_loss_fraction"]
    _check_fraction(corr)
    facts = _base_facts(spec, measured)
    saves, restore = _tiers(spec, checkpoint_bytes)
    # independent loss of the peer while the failed node is replaced: 1 − e^{−λ_node·R}
    fm = failure_model(spec.cluster, spec.reliability)
    node_rate = _kind_rates_per_s(spec, 0.0)["node"] / fm.num_nodes
    window = facts["detection.node"].value + facts["restart.agent_peer"].value + restore["peer"]
    pair_loss = corr + (1 - corr) * -math.expm1(-node_rate * window)
    rates = _kind_rates_per_s(spec, pair_loss)
    paths = {}
    for kind, (path, det_key, tier) in _paths(strategy).items():
        paths[kind] = PathCost(
            path, rates[kind], facts[det_key], facts[f"restart.{path}"], restore[tier], tier
        )
    save, storage = saves["in_memory" if strategy == "inprocess" else strategy], saves["async"]
    planned_cost = save.blocking_s + storage.persist_s * (strategy != "sync")
    planned_cost += facts["restart.agent_storage"].value + restore["storage"]
    res = StrategyResult(
        strategy=strategy,
        num_gpus=spec.cluster.num_gpus,
        mtbf_s=fm.mtbf_s,
        blocking_s=save.blocking_s,
        persist_s=save.persist_s,
        storage_persist_s=0.0 if strategy == "sync" else storage.persist_s,
        paths=paths,
        planned_rate_per_s=fm.planned_rate_per_s,
        planned_cost_s=planned_cost,
        failures_during_recovery=spec.reliability.failures_during_recovery,
        interval_s=math.inf,
        ettr=0.0,
    )
    if not math.isfinite(fm.mtbf_s):
        return replace(res, ettr=1.0 / (1.0 + res.planned_rate_per_s * res.planned_cost_s))
    lo = max(res.persist_s, 1e-6 * fm.mtbf_s, 1e-3)
    tau = maximise_on_log_scale(res.ettr_at, lo, max(20.0 * fm.mtbf_s, 10.0 * lo))
    return replace(res, interval_s=tau, ettr=res.ettr_at(tau))


def compare_strategies(
    spec: RunSpec,
    gpu_counts: tuple[int, ...] | list[int] = DEFAULT_GPU_COUNTS,
    measured: Mapping[str, Fact] | None = None,
    correlated_loss_fraction: float | None = None,
) -> dict[int, dict[str, StrategyResult]]:
    """Every strategy at every GPU count (same node size, same checkpoint bytes)."""
    from aihpc.goodput.plot import with_scale
    from aihpc.perf.step.memory import checkpoint_bytes

    nbytes = checkpoint_bytes(spec.model, spec.training)
    out: dict[int, dict[str, StrategyResult]] = {}
    for n in gpu_counts:
        scaled = with_scale(spec, n)
        out[n] = {
            s: strategy_result(scaled, s, measured, correlated_loss_fraction, nbytes)
            for s in STRATEGIES
        }
    return out
