"""The colocated switch between training and generation, counted as NeMo-RL's Megatron path
moves it (v0.3.0-v0.6.0: ``refit_policy_generation`` and the step in nemo_rl/algorithms/grpo.py,
the Megatron policy worker's ``offload_before_refit``, ``offload_after_refit``,
``prepare_for_lp_inference``, ``prepare_for_training``, ``move_model``, ``move_optimizer``, and
vLLM's ``sleep(level=1)`` / ``wake_up`` in its CuMemAllocator), each copy priced at the rate of
its kind on the GPU's host (``overheads.host_rates``).

Per GPU and step, in the order the step runs them, under the NeMo-RL timer each falls in:

- ``prepare_for_generation``: ``offload_before_refit`` frees the gradient buffers (their storage
  resized to 0, no copy) and ``move_optimizer("cpu")`` copies every optimizer state tensor with
  a blocking ``.to("cpu")``, into fresh pageable memory; the engine wakes its weights (each
  weight allocation mapped again and ``cudaMemcpy``'d back from its pinned backup); the refit
  (``weight_sync``, priced in phases.py) runs; ``offload_after_refit`` copies the 16-bit
  parameter buffers into Megatron's pinned ``param_data_cpu`` (``copy_``, non_blocking) and
  frees them; the KV cache is mapped again (no copy);
- ``generation`` ends with the engine's ``sleep(level=1)``: each weight allocation copied to a
  pinned backup (``torch.empty(pin_memory=True)``, then ``cudaMemcpy``), the KV cache discarded;
- ``logprob_inference_prep``: the parameters come back from their pinned copy
  (``reload_from_cpu``);
- ``training_prep``: the gradient buffers reallocated and zeroed on the GPU, the optimizer state
  brought back by ``.to("cuda")`` from its pageable copy.

Disaggregated, NeMo-RL through v0.4.0 still moved the optimizer state every step:
``prepare_for_lp_inference`` ran ``offload_before_refit`` (its ``.to("cpu")``) and
``prepare_for_training`` brought it back, on the training side of the step
(``rl.offload_optimizer_for_logprob``, ``logprob_offload_moves``); from v0.5.0 that is
``policy.offload_optimizer_for_logprob``, false in every recipe.

The reference policy's swap inside the log-prob pass is priced with that pass
(phases.reference_swap_s). What the calls also do and is not priced: ``gc.collect()`` and
``torch.cuda.empty_cache()`` after each offload and after the sleep (a full collection's time is
its process's object count; the one published timing found, google/tunix #2086, is another
framework's heap).

Which code moves the state is ``rl.offload`` (OFFLOADS): ``nemo-rl``, the switch above;
``verl-megatron``, ``verl-fsdp``, ``verl-fsdp2`` and ``slime``, below; ``none``, nothing of the
training state (verl with its offloads off: the state stays on the GPUs while the engine
generates in what ``gpu_memory_utilization`` leaves it, ``resident_state_bytes``), only the
engine's sleep and wake.

verl's Megatron workers with ``megatron.param_offload`` / ``optimizer_offload`` / ``grad_offload``
(``offload = "verl-megatron"``; volcengine/verl at 588f972, 2025-07-08, the runs' date:
verl/workers/megatron_workers.py, verl/workers/sharding_manager/megatron_vllm.py and the
offload/load functions of verl/utils/megatron_utils.py) move the training state inside the
phases themselves, once per phase, under verl's step timers:

- ``reshard`` (the sharding manager's ``__enter__``): the 16-bit parameter buffers back from their
  pinned copy (``param_data.copy_(cpu_data, non_blocking=True)``), the engine's weights woken,
  the refit, then the parameters out again by ``offload_megatron_model_to_cpu``:
  ``param_data.data.cpu().pin_memory()``, a blocking copy into fresh pageable memory (its
  ``pin_memory`` host-to-host copy after it unpriced: a lower bound) and the buffer freed;
- ``gen`` ends with the engine's ``sleep(level=1)`` (as above);
- ``old_log_prob`` (``compute_log_prob``): the parameters in (pinned, ``load_grad=False``) and
  out (pageable) around the forward passes;
- ``update_actor``: the parameters in (pinned; the gradient buffers reallocated and zeroed on
  the GPU, no copy), the optimizer in (``load_megatron_optimizer``: the fp32 master shard and
  Adam's two moments by ``.to(device, non_blocking=True)`` from the pinned copies the offload
  made), the updates, then the parameters out (pageable) and the optimizer out
  (``.to("cpu", non_blocking=True)``, which PyTorch's ``_to_copy`` allocates pinned); the
  gradient buffers freed (resized to 0, no copy).

verl's FSDP workers with ``fsdp_config.param_offload`` / ``optimizer_offload`` make the same
moves in the same phases (verl/workers/fsdp_workers.py, sharding_manager/fsdp_vllm.py,
verl/utils/fsdp_utils.py at 588f972 and at b178a3c, 2026-01-29). What moves is FSDP's sharded
fp32 parameter (its master copy) and Adam's moments, the moments always by ``.to(device,
non_blocking=True)`` (``offload_fsdp_optimizer`` / ``load_fsdp_optimizer``): pinned. The
parameters: ``offload = "verl-fsdp"`` (``strategy: fsdp``, verl's default, FSDP1) by
``flat_param_to(device, non_blocking=True)``, pinned both ways, in both versions;
``offload = "verl-fsdp2"`` (``strategy: fsdp2``) at b178a3c by ``model.cpu()`` and
``model.to(device)``, pageable both ways (588f972 still moved each ``param.data`` non_blocking).
The moves around ``compute_log_prob`` and ``update_actor`` are the actor worker's own, so they
are priced in a disaggregated placement too; the reshard's and the sleep's only when colocated.

slime's ``--colocate`` (``offload = "slime"``; THUDM/slime at 624b824, its actor
``slime/backends/megatron_utils/actor.py``, and torch_memory_saver, which slime preloads into its
training processes with a CPU backup): after the rollout ``wake_up`` resumes the memory saver's
region, a blocking ``cudaMemcpy`` from a pinned backup of every allocation outside the parameter
and gradient buffers (the distributed optimizer's fp32 master and moments), and restores the
16-bit parameters from slime's own pinned copy; after the update slime copies the parameters to
that pinned copy again, and ``sleep`` pauses the region (the optimizer state out, pinned, the
parameter and gradient buffers released without a copy); the weight update copies the pinned
parameters onto the GPU and hands them to SGLang by CUDA IPC. SGLang's own weights and KV cache
are released without a copy. All pinned; none when the pools are apart (slime offloads only when
colocated). Its reference swap is two copies, not NeMo-RL's three (phases.reference_swap_s).

verl's ``init_megatron_optim_config`` sets a distributed optimizer and no precision-aware
optimizer: the optimizer state moved is the step model's whole optimizer shard (fp32 master and
moments). The reference policy (``ref.megatron.param_offload``) is priced with the log-prob pass
where the run has one (phases.reference_swap_s).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aihpc.perf.rl.overheads import HostRates, host_rates
from aihpc.perf.rl.phases import sync_bytes
from aihpc.perf.step.estimate import Estimate
from aihpc.perf.step.memory import MOMENTS, GiB
from aihpc.runspec.cluster import ClusterSpec
from aihpc.runspec.model import ModelSpec
from aihpc.runspec.rl import OFFLOADS, RLSpec
from aihpc.runspec.training import DTYPE_BYTES, TrainingSpec

__all__ = [
    "MASTER_REMAINDER_BYTES",
    "OFFLOADS",
    "VERL_IN_PHASE",
    "Move",
    "Switch",
    "colocated_moves",
    "engine_moves",
    "logprob_offload_moves",
    "moves_s",
    "optimizer_state_bytes",
    "price_switch",
    "resident_state_bytes",
    "slime_moves",
    "verl_moves",
]

COPY_KINDS = ("pinned", "pageable")
TIMERS = ("prepare_for_generation", "generation", "logprob_inference_prep", "training_prep")
VERL_TIMERS = ("reshard", "gen", "old_log_prob", "update_actor")
# verl's timers that are RL phases of their own: their moves are priced inside the phase
VERL_IN_PHASE = {"old_log_prob": "old_logprob", "update_actor": "update"}

# Megatron-Core's distributed optimizer with use_precision_aware_optimizer (set by every NeMo-RL
# recipe, grpo_math_1B.yaml v0.3.0-v0.6.0) keeps, per parameter of the rank's optimizer shard,
# Adam's exp_avg and exp_avg_sq in their dtype (fp32) and the fp32 master weight as its low 16
# bits beside the bf16 parameter (OptimizerConfig.store_param_remainders = True, with bf16 and
# Transformer Engine >= 2.1; distrib_optimizer.py stores "master_param" as int16): all in the
# optimizer's state, so move_optimizer moves all three.
MASTER_REMAINDER_BYTES = 2.0


@dataclass(frozen=True)
class Move:
    """One host copy of the switch, per GPU."""

    what: str
    timer: str  # the NeMo-RL step timer it falls in (TIMERS)
    bytes: float
    kind: str  # COPY_KINDS
    to_host: bool

    def seconds(self, rates: HostRates) -> float:
        if self.kind == "pinned":
            rate = rates.pinned_d2h if self.to_host else rates.pinned_h2d
        else:
            rate = rates.pageable_d2h if self.to_host else rates.pageable_h2d
        return self.bytes / (rate * 1e9)


@dataclass(frozen=True)
class Switch:
    seconds: float
    to_host_gib: float  # per GPU, each step
    by_timer: dict[str, float]  # seconds under each NeMo-RL timer
    measured_pageable: bool  # False: the GPU's host has no measured pageable rate
    # seconds of moves inside another RL phase (verl: old_logprob, update), not in ``seconds``
    in_phases: dict[str, float] = field(default_factory=dict)


def optimizer_state_bytes(train: Estimate, training: TrainingSpec) -> float:
    """Bytes of the optimizer state tensors one GPU holds (what ``move_optimizer`` moves): the
    parameters of its optimizer shard (the step model's optimizer bytes over its bytes per
    parameter) times the moments and, with 16-bit parameters and an fp32 master, the master's
    16-bit remainder (MASTER_REMAINDER_BYTES); a bf16 master is kept whole."""
    o = DTYPE_BYTES[training.optimizer_dtype]
    moments = MOMENTS[training.optimizer]
    master = o
    if train.plan.zero_stage == 3:  # FSDP's sharded parameter is the master: moments only
        return float(train.memory.optimizer)
    if o == 4.0 and training.precision == "bf16":
        master = MASTER_REMAINDER_BYTES
    shard = train.memory.optimizer / ((1 + moments) * o)
    return shard * (moments * o + master)


def colocated_moves(
    train: Estimate, model: ModelSpec, rl: RLSpec, training: TrainingSpec
) -> list[Move]:
    """The switch's host copies per GPU and step (the module's docstring); none unless the
    rollout engines share the training GPUs."""
    if rl.placement != "colocated":
        return []
    weights = float(train.memory.weights)
    engine = sync_bytes(model, rl) / rl.rollout.gpus_per_engine
    state = optimizer_state_bytes(train, training)
    pre, gen, lp, tp = TIMERS
    return [
        Move("optimizer state out (move_optimizer .to('cpu'))", pre, state, "pageable", True),
        Move("engine weights in (wake_up, pinned backup)", pre, engine, "pinned", False),
        Move("parameters out (offload_after_refit)", pre, weights, "pinned", True),
        Move("engine weights out (sleep(level=1))", gen, engine, "pinned", True),
        Move("parameters in (prepare_for_lp_inference)", lp, weights, "pinned", False),
        Move("optimizer state in (move_optimizer .to('cuda'))", tp, state, "pageable", False),
    ]


def _verl_state(train: Estimate, training: TrainingSpec, fsdp: bool) -> tuple[float, float]:
    """(parameter bytes, optimizer bytes) per GPU that verl's offload moves. Megatron: the 16-bit
    parameter buffers and the distributed optimizer's shard (fp32 master and moments). FSDP: the
    sharded fp32 parameters (FSDP's master copy) and the moments; under ZeRO-3 the step model's
    optimizer bytes are the moments alone, so the shard is those over the moment count."""
    if fsdp and train.plan.zero_stage == 3:
        moments = float(train.memory.optimizer)
        return moments / MOMENTS[training.optimizer], moments
    return float(train.memory.weights), float(train.memory.optimizer)


def verl_moves(train: Estimate, model: ModelSpec, rl: RLSpec, training: TrainingSpec) -> list[Move]:
    """verl's offload moves per GPU and step (the module's docstring), for ``rl.offload`` =
    ``verl-megatron``, ``verl-fsdp`` or ``verl-fsdp2``. The moves around the old log-prob pass
    and the update are the workers' own and run in either placement; the reshard's and the
    engine's sleep only where the engines share the training GPUs (verl's hybrid engine)."""
    fsdp = rl.offload in ("verl-fsdp", "verl-fsdp2")
    weights, state = _verl_state(train, training, fsdp)
    # the parameters' copies each way: Megatron in from pinned, out by .cpu().pin_memory();
    # FSDP1 non_blocking both ways (pinned); FSDP2 model.to(device) / model.cpu() (pageable)
    in_kind = "pageable" if rl.offload == "verl-fsdp2" else "pinned"
    out_kind = "pinned" if rl.offload == "verl-fsdp" else "pageable"
    reshard, gen, lp, upd = VERL_TIMERS
    moves = [
        Move("parameters in (compute_log_prob)", lp, weights, in_kind, False),
        Move("parameters out (compute_log_prob)", lp, weights, out_kind, True),
        Move("parameters in (update_actor)", upd, weights, in_kind, False),
        Move("optimizer state in (.to(device, non_blocking))", upd, state, "pinned", False),
        Move("parameters out (update_actor)", upd, weights, out_kind, True),
        Move("optimizer state out (.to('cpu', non_blocking))", upd, state, "pinned", True),
    ]
    if rl.placement == "colocated":
        engine = sync_bytes(model, rl) / rl.rollout.gpus_per_engine
        moves[:0] = [
            Move("parameters in (load to GPU)", reshard, weights, in_kind, False),
            Move("engine weights in (wake_up, pinned backup)", reshard, engine, "pinned", False),
            Move("parameters out (offload to CPU)", reshard, weights, out_kind, True),
            Move("engine weights out (sleep(level=1))", gen, engine, "pinned", True),
        ]
    return moves


SLIME_TIMERS = ("wake_up", "backup", "update_weights", "sleep")


def slime_moves(train: Estimate) -> list[Move]:
    """slime's colocated moves per GPU and step (the module's docstring), all pinned."""
    weights, state = float(train.memory.weights), float(train.memory.optimizer)
    wake, backup, update, sleep = SLIME_TIMERS
    return [
        Move("optimizer state in (torch_memory_saver resume)", wake, state, "pinned", False),
        Move("parameters in (restore from the pinned copy)", wake, weights, "pinned", False),
        Move("parameters out (the pinned copy after the update)", backup, weights, "pinned", True),
        Move("parameters in (for the refit's IPC handles)", update, weights, "pinned", False),
        Move("optimizer state out (torch_memory_saver pause)", sleep, state, "pinned", True),
    ]


def engine_moves(model: ModelSpec, rl: RLSpec) -> list[Move]:
    """``rl.offload = "none"``: the training state stays on the GPUs; colocated, only the
    engine's weights go to their pinned backup at its sleep and back at its wake."""
    if rl.placement != "colocated":
        return []
    engine = sync_bytes(model, rl) / rl.rollout.gpus_per_engine
    return [
        Move("engine weights in (wake_up, pinned backup)", VERL_TIMERS[0], engine, "pinned", False),
        Move("engine weights out (sleep(level=1))", VERL_TIMERS[1], engine, "pinned", True),
    ]


def resident_state_bytes(train: Estimate) -> float:
    """Bytes of training state a GPU keeps while the engine generates with ``rl.offload =
    "none"``: its weights, gradients and optimizer state (the step model's)."""
    m = train.memory
    return float(m.weights + m.gradients + m.optimizer)


def logprob_offload_moves(train: Estimate, rl: RLSpec, training: TrainingSpec) -> list[Move]:
    """Disaggregated with ``rl.offload_optimizer_for_logprob``: the optimizer state out before
    the log-prob passes and back before the update, pageable both ways (``move_optimizer``);
    none otherwise (colocated, the switch has moved it out already)."""
    if rl.placement == "colocated" or not rl.offload_optimizer_for_logprob:
        return []
    state = optimizer_state_bytes(train, training)
    return [
        Move("optimizer state out (move_optimizer .to('cpu'))", TIMERS[2], state, "pageable", True),
        Move(
            "optimizer state in (move_optimizer .to('cuda'))", TIMERS[3], state, "pageable", False
        ),
    ]


def moves_s(moves: list[Move], cluster: ClusterSpec) -> float:
    """Seconds of ``moves`` one after another at their rates on the GPU's host."""
    if not moves:
        return 0.0
    rates = host_rates(cluster)
    return sum(m.seconds(rates) for m in moves)


def price_switch(
    train: Estimate,
    model: ModelSpec,
    cluster: ClusterSpec,
    rl: RLSpec,
    training: TrainingSpec,
) -> Switch:
    """The switch's seconds per step: every move of ``rl.offload``'s code at its copy kind's rate
    on the GPU's host, one after another (each call's copies are synchronous: ``.to("cpu")`` and
    vLLM's ``cudaMemcpy`` block, the non_blocking copies are waited for before the next call).
    verl's moves under its ``old_log_prob`` and ``update_actor`` timers go to ``in_phases``
    (those RL phases), not ``seconds``."""
    timers = VERL_TIMERS  # verl's workers' timers (none: the engine's moves alone)
    if rl.offload == "none":
        moves = engine_moves(model, rl)
    elif rl.offload == "slime":
        moves = slime_moves(train) if rl.placement == "colocated" else []
        timers = SLIME_TIMERS
    elif rl.offload == "nemo-rl":
        moves = colocated_moves(train, model, rl, training)
        timers = TIMERS
    else:
        moves = verl_moves(train, model, rl, training)
    if not moves:
        return Switch(0.0, 0.0, {}, True)
    rates = host_rates(cluster)
    by_timer = dict.fromkeys(timers, 0.0)
    for move in moves:
        by_timer[move.timer] += move.seconds(rates)
    to_host = sum(m.bytes for m in moves if m.to_host) / GiB
    inside = {VERL_IN_PHASE[t]: s for t, s in by_timer.items() if t in VERL_IN_PHASE}
    seconds = sum(s for t, s in by_timer.items() if t not in VERL_IN_PHASE)
    return Switch(seconds, to_host, by_timer, rates.measured_pageable, inside)
