"""A VLM launch's measured step time beside ``estimate_vlm``'s prediction (perf/multimodal/),
with the imbalance the image distribution brings: the predicted encoder term and its expected-
maximum excess over the ranks (``encoder_imbalance``), and what the ranks measured, step by step:
the images each data-parallel rank encoded and its encoder's forward seconds (the slowest rank's
excess over the mean)."""

from __future__ import annotations

import statistics
from typing import Any

from aihpc.runspec import RunSpec, SpecError
from aihpc.runtime.summary import as_trained, measured_vs_predicted, spec_for_this_machine

__all__ = ["measured_imbalance", "vlm_measured_vs_predicted"]

# the trainer runs the encoder on every TP / CP rank of the first stage (runspec/vlm_rules.py)
PLACEMENT = "replicated"


def measured_imbalance(image_log: list[dict[str, Any]]) -> dict[str, Any]:
    """Over the steps after the first: the ranks that ran the encoder, their mean and largest
    images per step, and the mean (over steps) of the slowest rank's encoder forward seconds
    and of its excess over the ranks' mean (the measured counterpart of encoder_imbalance, a
    forward only: the backward runs inside the decoder's)."""
    steps = image_log[1:] or image_log
    if not steps:
        return {}
    ranks = [
        r for r in range(len(steps[0]["images"])) if any(s["encoder_forward_s"][r] for s in steps)
    ]
    if not ranks:
        return {}
    images = [[s["images"][r] for r in ranks] for s in steps]
    times = [[s["encoder_forward_s"][r] for r in ranks] for s in steps]
    return {
        "encoder_ranks": len(ranks),
        "images_per_rank_mean": statistics.fmean(statistics.fmean(i) for i in images),
        "images_per_rank_max": statistics.fmean(max(i) for i in images),
        "encoder_forward_s_mean": statistics.fmean(statistics.fmean(t) for t in times),
        "encoder_forward_s_max": statistics.fmean(max(t) for t in times),
        "encoder_forward_imbalance_s": statistics.fmean(
            max(t) - statistics.fmean(t) for t in times
        ),
    }


def vlm_measured_vs_predicted(
    spec: RunSpec,
    step_times: list[float],
    world_size: int,
    device: str,
    image_log: list[dict[str, Any]],
) -> dict[str, Any]:
    """``summary.measured_vs_predicted``'s figures with the prediction of the whole VLM step
    (language model, encoder and projector at placement "replicated", the imbalance), its terms,
    and the measured imbalance."""
    from aihpc.perf.multimodal.estimate import estimate_vlm

    out = measured_vs_predicted(spec, step_times, world_size, device)
    out["predicted_llm_step_time_s"] = out["predicted_step_time_s"]
    priced, _ = spec_for_this_machine(spec, device, world_size)
    est = None
    if priced is not None:
        try:
            est = estimate_vlm(as_trained(priced), placement=PLACEMENT)
        except SpecError as err:
            out["no_prediction"] = f"estimate_vlm cannot price it: {err}"
    measured = out["measured_step_time_s"]
    llm_s, llm_mfu = out["predicted_step_time_s"], out["predicted_mfu"]
    # MFU counts the language model's FLOPs (as the measured one): at the whole step's time
    out["predicted_mfu"] = llm_mfu * llm_s / est.step_time_s if est and llm_mfu else None
    out["predicted_step_time_s"] = est.step_time_s if est else None
    out["step_time_error"] = est.step_time_s / measured - 1.0 if est and measured else None
    out["placement"] = PLACEMENT
    out["predicted_terms_s"] = dict(est.time_s) if est else None
    out["imbalance"] = {
        "predicted_encoder_s": est.time_s["encoder"] if est else None,
        "predicted_encoder_imbalance_s": est.time_s["encoder_imbalance"] if est else None,
        # a rank's encoder forwards in a step: what the trainer times around its encoder calls
        "predicted_encoder_forward_s": est.imbalance["step_forward_s"] if est else None,
        "measured": measured_imbalance(image_log),
    }
    return out
