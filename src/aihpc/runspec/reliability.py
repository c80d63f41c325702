"""ReliabilitySpec: ``[reliability]`` — failure rates and recovery costs for the goodput model.

Owned by the goodput work (aihpc.goodput.ettr); every default carries its source in
``aihpc/goodput/data/reliability.toml``. A field left out (None) takes that default. Example::

    [reliability]
    checkpoint_strategy = "in_memory"      # sync | async | in_memory
    failure_rate_scale = 2.0               # twice the published per-component rates
    failure_rates = { gpu_hbm = 5e-6 }     # one component, failures per unit-hour
    restart_time_s = 60                    # hot spares + in-process restart
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aihpc.runspec._table import check_choice, check_positive
from aihpc.runspec.errors import SpecError

__all__ = ["CHECKPOINT_STRATEGIES", "ReliabilitySpec"]

CHECKPOINT_STRATEGIES = ("sync", "async", "in_memory")


@dataclass(frozen=True)
class ReliabilitySpec:
    """Overrides of the published default failure and recovery figures (none set = defaults)."""

    # How checkpoints are taken. None: "async" when [checkpoint] async_save (the default), else
    # "sync". in_memory = snapshot to host memory and replicate to a peer node (Gemini, NVRx local
    # checkpoints); restart reads the peer copy instead of the file system.
    checkpoint_strategy: str | None = None
    checkpoint_interval_s: float | None = None  # None: the ETTR-optimal interval
    # Failure rates. failure_rates overrides single components (names and units as in
    # goodput/data/reliability.toml: failures per GPU-hour or per node-hour); failure_rate_scale
    # multiplies every unexpected-failure rate; mtbf_s replaces the whole sum.
    failure_rates: dict[str, Any] | None = None
    failure_rate_scale: float | None = None
    mtbf_s: float | None = None
    planned_interruptions_per_day: float | None = None
    # Recovery: detection + restart (rescheduling, relaunch, init) + load of the checkpoint.
    detection_time_s: float | None = None
    restart_time_s: float | None = None
    load_time_s: float | None = None  # None: checkpoint bytes / read bandwidth
    failures_during_recovery: bool = True  # a failure can strike while the job restarts
    # Checkpoint cost. None: derived from checkpoint bytes and bandwidths.
    checkpoint_blocking_s: float | None = None  # training paused per save
    checkpoint_persist_s: float | None = None  # background persist until the save is durable
    checkpoint_overhead_s: float | None = None  # fixed coordination cost of every save
    host_copy_bw_GBps: float | None = None  # per-GPU device-to-host staging bandwidth

    def __post_init__(self) -> None:
        if self.checkpoint_strategy is not None:
            check_choice(
                "reliability.checkpoint_strategy", self.checkpoint_strategy, CHECKPOINT_STRATEGIES
            )
        for f in ("checkpoint_interval_s", "failure_rate_scale", "mtbf_s", "host_copy_bw_GBps"):
            check_positive(f"reliability.{f}", getattr(self, f))
        for f in (
            "planned_interruptions_per_day",
            "detection_time_s",
            "restart_time_s",
            "load_time_s",
            "checkpoint_blocking_s",
            "checkpoint_persist_s",
            "checkpoint_overhead_s",
        ):
            check_positive(f"reliability.{f}", getattr(self, f), allow_zero=True)
        for name, rate in (self.failure_rates or {}).items():
            field = f"reliability.failure_rates.{name}"
            if isinstance(rate, bool) or not isinstance(rate, int | float):
                raise SpecError(field, rate, "expected a number (failures per unit-hour)")
            check_positive(field, rate, allow_zero=True)
