"""What the performance model predicts for a run spec, exported beside the measured metrics
(``aihpc estimate``'s step time, tokens/s, MFU and memory; ``aihpc goodput``'s ETTR). No torch."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from aihpc.runspec import RunSpec, SpecError

__all__ = ["RunPrediction", "predict"]

log = logging.getLogger("aihpc.observe")


@dataclass(frozen=True)
class RunPrediction:
    """What ``aihpc estimate`` / ``aihpc goodput`` predict for the spec, and the MFU constants."""

    step_time_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    memory_bytes: float
    ettr: float | None
    model_flops_per_token: float
    peak_flops: float


def predict(spec: RunSpec) -> RunPrediction | None:
    """The performance model's figures for ``spec`` (None when the model cannot price it)."""
    from aihpc.goodput.ettr import goodput_report
    from aihpc.perf.step import estimate
    from aihpc.perf.step.flops import model_flops_per_token

    try:
        est = estimate(spec)
        peak = spec.cluster.gpu.peak_tflops(spec.training.precision) * 1e12
    except SpecError as err:
        log.warning("no prediction for the metrics: %s", err)
        return None
    try:
        ettr: float | None = goodput_report(spec, est.step_time_s).ettr
    except SpecError:
        ettr = None
    return RunPrediction(
        step_time_s=est.step_time_s,
        tokens_per_s_per_gpu=est.tokens_per_s_per_gpu,
        mfu=est.mfu,
        memory_bytes=est.memory.total,
        ettr=ettr,
        model_flops_per_token=model_flops_per_token(spec.model),
        peak_flops=peak,
    )
