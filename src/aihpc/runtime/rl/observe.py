"""What a GRPO run shows beside its metrics.jsonl: the Prometheus figures of metrics.py
(``RLMetrics``) plus each phase's last seconds and the planner's prediction of them, and in
summary.json the measured phases beside the predicted ones.

The prediction is ``aihpc rl estimate``'s model (perf/rl, ``in_process``: the step as this
runtime runs it, with no serving engine's host work, sleep or orchestration) for the run's
own spec priced on the machine the launch ran on, exactly as ``aihpc train`` chooses it
(runtime/summary.py ``spec_for_this_machine``: the spec where its [cluster] describes this
device, else its ``aihpc calibrate --local`` copy for this host, else none and why), with
the run's real lengths (the task's prompt, the measured mean response) and its real update
(each rank's share of ``[parallel].global_batch_size`` in one pass, as the trainer runs it).

    aihpc_rl_phase_last_seconds{phase}        the last step's seconds per phase
    aihpc_rl_predicted_phase_seconds{phase}   the prediction per phase (absent: no prediction)

phase: rollout | logprob | reward | update | weight_sync. The rule reward is scored as each
response finishes, inside the rollout; ``reward`` is the time a step reports apart (none yet).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from prometheus_client import Gauge

from aihpc.runspec import RunSpec, SpecError
from aihpc.runtime.rl.metrics import RLMetrics

__all__ = ["OBSERVED_PHASES", "RLObserver", "predict_phases", "runtime_phases"]

OBSERVED_PHASES = ("rollout", "logprob", "reward", "update", "weight_sync")

# the planner's phases (perf/rl/step.py) that each measured phase holds
_PLANNED = {
    "rollout": ("rollout",),
    "logprob": ("old_logprob", "ref_logprob", "critic_values"),
    "reward": ("reward",),
    "update": ("update", "critic_update"),
    "weight_sync": ("weight_sync", "switch"),
}


def runtime_phases(planned: dict[str, float]) -> dict[str, float]:
    """The planner's phases summed into the ones the runtime measures."""
    return {p: sum(planned.get(k, 0.0) for k in ks) for p, ks in _PLANNED.items()}


def predict_phases(
    spec: RunSpec,
    world_size: int,
    device: str,
    prompt_len: int,
    response_len: float,
    max_response_len: int,
) -> tuple[dict[str, float] | None, str | None, str | None]:
    """(predicted seconds per measured phase, None, the spec file priced), or (None, why, None)
    where no spec describes this machine or the model cannot price it."""
    from aihpc.perf.rl import estimate_rl
    from aihpc.runtime.summary import as_trained, spec_for_this_machine

    priced, why = spec_for_this_machine(spec, device, world_size)
    if priced is None or priced.rl is None:
        return None, why or "no [rl] table to price", None
    cap = max(1, max_response_len)
    rl = dataclasses.replace(
        priced.rl,
        prompt_len=max(1, prompt_len),
        response_len=min(cap, max(1, round(response_len))),
        max_response_len=cap,
        response_dist="fixed",
    )
    plan = priced.plan()
    share = max(1, plan.global_batch_size // max(1, world_size))
    plan = dataclasses.replace(plan, micro_batch_size=share)  # one pass per optimizer step
    try:
        run = as_trained(dataclasses.replace(priced, rl=rl))
        # the trainer right-pads every response to the cap (grpo.py): no packing
        est = estimate_rl(run, plan, in_process=True, batching="padded")
    except (SpecError, ValueError) as err:
        return None, f"no prediction: aihpc rl estimate cannot price this run ({err})", None
    return runtime_phases(est.phases_s), None, priced.path or "the run spec"


class RLObserver:
    """metrics.prom's RL figures (RLMetrics) with the phases' last seconds and their
    prediction; ``summary()`` the measured phases beside the predicted ones."""

    def __init__(
        self, metrics: RLMetrics, spec: RunSpec, world_size: int, device: str, task: Any
    ) -> None:
        self.metrics = metrics
        self.spec, self.world_size, self.device, self.task = spec, world_size, device, task
        from aihpc.observe.metrics import job_name

        labels = ["hpc_job", "rank", "phase"]
        base = {"hpc_job": job_name(metrics.path.parent), "rank": "0"}
        reg = self.metrics.registry
        last = Gauge("aihpc_rl_phase_last_seconds", "Last GRPO step's seconds by phase", labels,
                     registry=reg)  # fmt: skip
        self.predicted = Gauge("aihpc_rl_predicted_phase_seconds",
                               "aihpc rl estimate's seconds by phase for this run on this machine",
                               labels, registry=reg)  # fmt: skip
        self.last = {p: last.labels(**base, phase=p) for p in OBSERVED_PHASES}
        self.base = base
        self.measured: dict[str, list[float]] = {p: [] for p in OBSERVED_PHASES}
        self.lengths: list[float] = []
        self.prediction: dict[str, float] | None = None
        self.why: str | None = None
        self.priced: str | None = None

    def _predict(self) -> None:
        mean = statistics.fmean(self.lengths) if self.lengths else self.task.max_answer_len
        self.prediction, self.why, self.priced = predict_phases(
            self.spec, self.world_size, self.device, self.task.prompt_len, mean,
            self.task.max_answer_len,
        )  # fmt: skip
        for p, value in (self.prediction or {}).items():
            self.predicted.labels(**self.base, phase=p).set(value)

    def record(self, m: dict) -> None:
        """One step's metrics line into the figures and metrics.prom (RLMetrics writes it)."""
        for p in OBSERVED_PHASES:
            value = float(m.get(f"{p}_s", 0.0))
            self.measured[p].append(value)
            self.last[p].set(value)
        self.lengths.append(float(m.get("response_len", 0.0)))
        if self.prediction is None and self.why is None:  # priced once, after the first step
            self._predict()
        self.metrics.record(m)

    def summary(self) -> dict[str, Any]:
        """Per phase the measured median (over the steps after the first, which pays for first
        allocations) beside the prediction, priced at the run's mean response length."""
        if self.lengths:
            self._predict()
        out: dict[str, Any] = {
            "prediction_for": self.priced,
            "no_prediction": self.why,
            "device": self.device,
            "phases": {},
        }
        for p in OBSERVED_PHASES:
            timed = self.measured[p][1:] or self.measured[p]
            measured = statistics.median(timed) if timed else None
            predicted = self.prediction.get(p) if self.prediction else None
            error = predicted / measured - 1.0 if predicted is not None and measured else None
            out["phases"][p] = {"measured_s": measured, "predicted_s": predicted, "error": error}
        return out
