"""One RL step priced as named phases, and put together on the critical path.

Synchronous (staleness 0): the phases run one after another: rollout (and ReMax's greedy
baseline rollout after it), the colocated switch
(training state and the engine's weights through host memory, perf/rl/switch.py), the
forward-only passes (old-policy and reference log-probs, critic values, reward model), the
update(s), the weight sync and the trainer's orchestration between phases
(perf/rl/overheads.py); the pool that is not working waits.
Asynchronous (staleness k >= 1, disaggregated): the rollout pool generates step n+1 while the
training pool learns from step n, so the step is the slower pool, plus the sync both stop for
(the rollout engines take the new weights between steps, NeMo-RL's in-flight weight update).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from aihpc.perf.rl.overheads import overheads, training_ceiling_s
from aihpc.perf.rl.phases import (
    Training,
    price_training,
    reference_swap_s,
    sync_bytes,
    sync_s,
)
from aihpc.perf.rl.rollout import Rollout, price_rollout
from aihpc.perf.rl.switch import (
    Switch,
    logprob_offload_moves,
    moves_s,
    price_switch,
    resident_state_bytes,
)
from aihpc.perf.step.memory import GiB
from aihpc.perf.step.params import DEFAULT_PARAMS, ModelParams
from aihpc.runspec.errors import SpecError
from aihpc.runspec.model import ModelSpec, model_from_table
from aihpc.runspec.parallel import ParallelPlan, plan_problem
from aihpc.runspec.rl import RLSpec
from aihpc.runspec.runspec import RunSpec

__all__ = ["RLEstimate", "computed_tokens", "estimate_rl"]

TRAIN_SIDE = (
    "old_logprob",
    "ref_logprob",
    "critic_values",
    "reward",
    "critic_update",
    "update",
    "optimizer_offload",
    "orchestration",
)


@dataclass(frozen=True)
class RLEstimate:
    rl: RLSpec
    plan: ParallelPlan
    num_gpus: int
    rollout_gpus: int
    train_gpus: int
    phases_s: dict[str, float]  # every phase's seconds (each on its own pool)
    step_time_s: float  # the critical path
    rollout: Rollout
    actor: Training
    switch_gib: float  # training state and engine weights moved to host per GPU (colocated)
    sync_gib: float
    fits: bool
    notes: list[str] = field(default_factory=list)
    # the colocated moves' seconds under each step timer (NeMo-RL's or verl's, perf/rl/switch.py)
    switch_by_timer: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_step(self) -> float:
        return self.rl.samples_per_step * (self.rl.prompt_len + self.rl.response_len)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """The step's tokens (prompts and responses) per second per GPU of the job (NeMo-RL's
        Tokens / sec / GPU)."""
        return self.tokens_per_step / self.step_time_s / self.num_gpus

    @property
    def bottleneck(self) -> str:
        name = max(self.phases_s, key=lambda k: self.phases_s[k])
        share = self.phases_s[name] / self.step_time_s
        return f"{name}: {share:.0%} of the step"

    def to_json(self) -> dict[str, Any]:
        return {
            "placement": self.rl.placement,
            "staleness": self.rl.staleness,
            "num_gpus": self.num_gpus,
            "rollout_gpus": self.rollout_gpus,
            "train_gpus": self.train_gpus,
            "rollout_layout": {"tp": self.rl.rollout.tp, "pp": self.rl.rollout.pp},
            "training_plan": self.plan.as_dict(),
            "step_time_s": self.step_time_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "phases_s": self.phases_s,
            "rollout": self.rollout.to_json(),
            "training_fits": self.actor.estimate.fits,
            "training_memory_gib": self.actor.estimate.memory.gib(),
            "offload": self.rl.offload,
            "switch_offload_gib_per_gpu": self.switch_gib,
            "switch_s_by_timer": self.switch_by_timer,
            "sync_gib": self.sync_gib,
            "fits": self.fits,
            "bottleneck": self.bottleneck,
            "notes": self.notes,
        }


def _preset(name: str | None, actor: ModelSpec, field_name: str) -> ModelSpec:
    if not name:
        return actor
    try:
        return model_from_table({"preset": name})
    except SpecError as err:
        raise SpecError(field_name, name, err.allowed) from None


def _forward_phases(
    spec: RunSpec,
    plan: ParallelPlan,
    actor: Training,
    params: ModelParams,
    in_process: bool = False,
    batching: str = "packed",
):
    """(the forward-only phases, the critic's update, the reference's swap) in seconds."""
    rl, cluster = spec.rl, spec.training_cluster()
    assert rl is not None
    swap = 0.0
    out = {"old_logprob": actor.forward_s}
    out["ref_logprob"] = 0.0
    if rl.kl:
        ref = _preset(rl.reference, spec.model, "rl.reference")
        priced = price_training(ref, cluster, plan, spec.training, rl, params, batching)
        out["ref_logprob"] = priced.forward_s
        if not in_process:  # an RL framework's reference weights wait in host memory
            copies = 2.0 if rl.offload == "slime" else 3.0  # phases.reference_swap_s
            swap = reference_swap_s(priced.estimate, cluster, copies)
    out["critic_values"], critic_update = 0.0, 0.0
    if rl.algorithm == "ppo":
        critic = _preset(rl.critic, spec.model, "rl.critic")
        priced = price_training(critic, cluster, plan, spec.training, rl, params, batching)
        out["critic_values"], critic_update = priced.forward_s, priced.update_s
    out["reward"] = 0.0
    if rl.reward == "model":
        judge = _preset(rl.reward_model, spec.model, "rl.reward_model")
        judged = price_training(judge, cluster, plan, spec.training, rl, params, batching)
        # the reward model scores every generated sample, kept or filtered (DAPO)
        out["reward"] = judged.forward_s * rl.generated_prompts / rl.prompts_per_step
    return out, critic_update, swap


def estimate_rl(
    spec: RunSpec,
    plan: ParallelPlan | None = None,
    params: ModelParams = DEFAULT_PARAMS,
    in_process: bool = False,
    batching: str | None = None,
) -> RLEstimate:
    """Price the run spec's RL step (``[rl]``) under its training plan (or ``plan``).
    ``in_process``: the step as ``aihpc rl train`` runs it (its rollout copy of the policy in
    the training processes, kept resident): none of an RL framework's serving-engine host work,
    engine sleep and wake, offload, reference swap or orchestration between phases.
    ``batching``: how the update's and log-prob passes' micro-batches are formed
    (perf/rl/batching.py), in place of the spec's ``rl.batching``.
    ``rl.offload`` says whose code moves the training state through host memory
    (perf/rl/switch.py)."""
    rl = spec.rl
    if rl is None:
        raise SpecError("rl", None, "required: an [rl] table (docs/rl.md)")
    batching = batching or rl.batching
    cluster, train_cluster = spec.cluster, spec.training_cluster()
    plan = plan or spec.plan()
    problem = plan_problem(plan, spec.model, train_cluster)
    if problem is not None:
        raise problem
    rollout_gpus, train_gpus = rl.pools(cluster.num_gpus)
    actor = price_training(spec.model, train_cluster, plan, spec.training, rl, params, batching)
    rollout = price_rollout(spec.model, cluster, rl, rollout_gpus, params, not in_process)
    phases, critic_update, swap = _forward_phases(spec, plan, actor, params, in_process, batching)
    baseline = _baseline_rollout_s(spec, rollout_gpus, params, in_process)
    phases = {"rollout": rollout.time_s, "baseline_rollout": baseline, **phases}
    phases["critic_update"] = critic_update
    phases["update"] = actor.update_s
    _ceiling(phases, spec, train_gpus, actor)
    phases["ref_logprob"] += swap  # host copies: no GPU ceiling bounds them
    switch = Switch(0.0, 0.0, {}, True)
    if not in_process:
        switch = price_switch(actor.estimate, spec.model, cluster, rl, spec.training)
    phases["switch"] = switch.seconds
    for phase, seconds in switch.in_phases.items():  # host copies: no GPU ceiling bounds them
        phases[phase] += seconds
    opt_moves = [] if in_process else logprob_offload_moves(actor.estimate, rl, spec.training)
    phases["optimizer_offload"] = moves_s(opt_moves, train_cluster)
    phases["orchestration"] = 0.0 if in_process else overheads().orchestration_s
    phases["weight_sync"] = sync_s(spec.model, cluster, rl, train_gpus, params, plan)
    train_side = sum(phases[k] for k in TRAIN_SIDE)
    if rl.staleness:
        rollout_side = rollout.time_s + phases["baseline_rollout"]
        step = max(rollout_side, train_side) + phases["weight_sync"]
    else:
        step = sum(phases.values())
    notes = _notes(rollout, actor, rl)
    resident = _resident_problem(spec, actor) if not in_process else ""
    if resident:
        notes.append(resident)
    if not switch.measured_pageable:
        notes.append(
            f"no measured pageable host-copy rate for {cluster.gpu.id}'s host "
            "(perf/rl/data/overheads.toml [[host_copy]]): the optimizer's offload is priced "
            "at the pinned rate, a lower bound"
        )
    return RLEstimate(
        rl=rl,
        plan=plan,
        num_gpus=cluster.num_gpus,
        rollout_gpus=rollout_gpus,
        train_gpus=train_gpus,
        phases_s=phases,
        step_time_s=step,
        rollout=rollout,
        actor=actor,
        switch_gib=switch.to_host_gib,
        sync_gib=sync_bytes(spec.model, rl) / 2**30,
        fits=rollout.fits and actor.estimate.fits and not resident,
        notes=notes,
        switch_by_timer=switch.by_timer,
    )


def _ceiling(phases: dict[str, float], spec: RunSpec, train_gpus: int, actor: Training) -> None:
    """The actor's update and forward passes no faster than Megatron Core pre-trains the model
    on this GPU (overheads.training_ceiling_s; a forward pass is a third of a training pass).
    The rate is the one published for the run's MoE stack where a row names it
    (overheads.ceiling_rate). A pre-training rate counts the tokens its GPUs compute (packed 4K
    sequences, no padding), so the ceiling is paid on the tokens the update computes: the
    samples' tokens over the share of the micro-batches they fill (``Batches.useful``)."""
    rl = spec.rl
    assert rl is not None
    tokens = computed_tokens(rl, actor)
    stack = spec.training.moe_stack
    floor = training_ceiling_s(spec.model, spec.training_cluster(), tokens, train_gpus, stack)
    phases["update"] = max(phases["update"], floor * rl.ppo_epochs)
    phases["old_logprob"] = max(phases["old_logprob"], floor / 3)
    if rl.kl and not rl.reference:  # the reference has the actor's shape
        phases["ref_logprob"] = max(phases["ref_logprob"], floor / 3)


def _baseline_rollout_s(
    spec: RunSpec, rollout_gpus: int, params: ModelParams, in_process: bool
) -> float:
    """ReMax's baseline: one greedy response per prompt, generated by the rollout engines after
    the sampled ones (verl's ``gen_max`` timer, a second ``generate_sequences`` call), priced as
    a rollout of ``prompts_per_step`` sequences of the same length distribution (a greedy
    response's length is the policy's, as a sampled one's is); 0 for the other algorithms."""
    rl = spec.rl
    assert rl is not None
    if rl.algorithm != "remax":
        return 0.0
    greedy = replace(rl, samples_per_prompt=1)
    return price_rollout(
        spec.model, spec.cluster, greedy, rollout_gpus, params, not in_process
    ).time_s


def _resident_problem(spec: RunSpec, actor: Training) -> str:
    """Colocated with ``rl.offload = "none"``: the training state the GPU keeps must fit in what
    the engine's ``gpu_memory_utilization`` leaves of its memory (vLLM takes that share of the
    whole GPU while the state stays); "" when it does."""
    rl = spec.rl
    assert rl is not None
    if rl.placement != "colocated" or rl.offload != "none":
        return ""
    gpu = spec.cluster.gpu
    state = resident_state_bytes(actor.estimate) / GiB
    room = (1 - rl.rollout.gpu_memory_utilization) * gpu.hbm_gib
    if state <= room:
        return ""
    return (
        f'with rl.offload = "none" the training state stays on the GPU ({state:.1f} GiB) while '
        f"the engine takes gpu_memory_utilization {rl.rollout.gpu_memory_utilization:g} of "
        f"{gpu.hbm_gib:g} GiB, leaving {room:.1f} GiB: lower it, shard the training state "
        "further, or offload (rl.offload)"
    )


def computed_tokens(rl: RLSpec, actor: Training) -> float:
    """Tokens the update's micro-batches compute in one RL step: the samples' prompt and
    response tokens, plus the padding the batching adds (``Batches.useful`` is their share)."""
    tokens = rl.samples_per_step * (rl.prompt_len + rl.response_len)
    return tokens / max(actor.batches.useful, 1e-9)


def _notes(rollout: Rollout, actor: Training, rl: RLSpec) -> list[str]:
    out = []
    if not rollout.fits:
        out.append(f"the rollout does not fit: {rollout.why} (raise it or rl.rollout.tp)")
    if not actor.estimate.fits:
        out.append("the training plan does not fit: " + actor.estimate.bottleneck)
    if rl.batching == "unpadded":
        per_rank = actor.batches.microbatches * actor.optimizer_steps
        out.append(
            f"fixed micro-batches ({per_rank} a rank each step): published verl updates with 2 "
            "sequences a micro-batch took 2-3x their dynamic-batching twins' time, ~110-150 ms "
            "a micro-batch more than their FLOPs, which this model does not price (docs/rl.md, "
            'verl\'s dense rows): dynamic batching (rl.batching = "packed") makes fewer'
        )
    return out


def with_rl(spec: RunSpec, rl: RLSpec) -> RunSpec:
    """``spec`` with another ``[rl]`` (the search's placements), checked as a run spec is."""
    return replace(spec, rl=rl)
