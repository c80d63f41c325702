"""What each framework runs, for the CLI: the rules `aihpc search --for` keeps the search inside
(the same functions the exports refuse plans with), and the run spec as the framework runs an
export, whose estimate `aihpc export` prints when it differs from the run spec's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aihpc.runspec import ParallelPlan, RunSpec, SpecError

__all__ = ["SEARCH_FRAMEWORKS", "as_run", "estimate_line", "plan_rules"]

SEARCH_FRAMEWORKS = ("megatron", "torchtitan", "deepspeed")


def plan_rules(framework: str, spec: RunSpec) -> Callable[[ParallelPlan], SpecError | None]:
    """The framework's refusal of one plan of ``spec`` (None: it runs it); SpecError at once
    where it runs no plan of this model or training (the model is no torchtitan flavor, say)."""
    if framework not in SEARCH_FRAMEWORKS:
        raise SpecError("--for", framework, "allowed: " + " | ".join(SEARCH_FRAMEWORKS))
    m, t = spec.model, spec.training
    if framework == "megatron":
        from aihpc.interop.megatron.runs import megatron_refusal, megatron_training_refusal

        _raise(megatron_training_refusal(m, t))
        return lambda plan: megatron_refusal(m, plan, t)
    if framework == "torchtitan":
        from aihpc.interop.torchtitan import writer

        _raise(writer.torchtitan_model_refusal(spec))
        _raise(writer.torchtitan_training_refusal(t))
        torchtitan_refusal = writer.torchtitan_refusal
        return lambda plan: torchtitan_refusal(m, plan, t)
    from aihpc.interop.deepspeed.writer import deepspeed_refusal, deepspeed_training_refusal

    _raise(deepspeed_training_refusal(t))
    return lambda plan: deepspeed_refusal(m, plan, t)


def _raise(err: SpecError | None) -> None:
    if err is not None:
        raise err


def as_run(framework: str, spec: RunSpec) -> tuple[RunSpec, list[str]]:
    """(the run spec as ``framework`` runs its export, the fields that changed)."""
    if framework == "megatron":
        from aihpc.interop.megatron.writer import megatron_as_run

        return megatron_as_run(spec)
    if framework == "torchtitan":
        from aihpc.interop.torchtitan.writer import torchtitan_as_run

        return torchtitan_as_run(spec)
    if framework == "deepspeed":
        from aihpc.interop.deepspeed.writer import deepspeed_as_run

        return deepspeed_as_run(spec)
    return spec, []


def estimate_line(framework: str, spec: RunSpec) -> tuple[str | None, dict[str, Any] | None]:
    """(the line naming the estimate of the plan as the framework runs it, its JSON) where that
    estimate differs from the run spec's; (None, None) where it does not."""
    ran, changes = as_run(framework, spec)
    if not changes:
        return None, None
    from aihpc.perf.step.estimate import estimate

    ours, theirs = estimate(spec), estimate(ran)
    same = ours.step_time_s == theirs.step_time_s and ours.memory.total == theirs.memory.total
    if same:
        return None, None
    gib = 2**30
    line = (
        f"estimate as {framework} runs it: {theirs.step_time_s:.3f} s/step, "
        f"{theirs.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, {theirs.memory.total / gib:.1f} GiB "
        f"per GPU (the run spec's: {ours.step_time_s:.3f} s/step, "
        f"{ours.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, {ours.memory.total / gib:.1f} GiB), "
        f"as it runs {'; '.join(changes)}"
    )
    data = {
        "changes": changes,
        "step_time_s": theirs.step_time_s,
        "tokens_per_s_per_gpu": theirs.tokens_per_s_per_gpu,
        "memory_GiB": theirs.memory.total / gib,
        "fits": theirs.fits,
    }
    return line, data
