"""What aihpc's own trainer (``aihpc.runtime``) runs, as rules without torch: the one place
planner and trainer share them.

``aihpc train`` refuses a spec with the first of these before any process starts
(``runtime/checks.py``); ``aihpc search`` marks each plan it prints with the same answer
(``runnable``, ``trainer_refuses``), keeps only the plans it runs with ``--runnable``, and its
candidate generator offers, under ``--runnable``, the MoE options the trainer has
(``TRAINER_A2A_OVERLAPS``, ``trainer_etps``). Each refusal is one ``SpecError`` naming the field,
the value and what is allowed; docs/runtime.md lists them with their reasons.

The spec's own rules (``plan_problem``: tp divides the heads, 2 x cp divides the sequence, ...)
hold already; these are the trainer's on top: what it implements, and what
torch.distributed.pipelining's schedules and its tensor-parallel layout can execute.
"""

from __future__ import annotations

from collections.abc import Callable

from aihpc.runspec.errors import SpecError
from aihpc.runspec.model import ModelSpec
from aihpc.runspec.parallel import ParallelPlan
from aihpc.runspec.runspec import RunSpec
from aihpc.runspec.training import TrainingSpec
from aihpc.runspec.vlm_rules import trainer_vision_refusal

__all__ = [
    "TRAINER_A2A_OVERLAPS",
    "TRAINER_ATTENTION",
    "TRAINER_RECOMPUTE_MODULES",
    "trainer_compile_refusal",
    "trainer_etps",
    "trainer_model_refusal",
    "trainer_plan_refusal",
    "trainer_plan_rule",
    "trainer_refusal",
    "trainer_training_refusal",
]

# The MoE all-to-all runs in line with compute (dispatch, experts, combine in order).
TRAINER_A2A_OVERLAPS = ("none",)
# The parallel.recompute_modules the trainer recomputes (runtime/model.py, moe.py); mla_up_proj
# needs MLA, which it does not have (trainer_model_refusal).
TRAINER_RECOMPUTE_MODULES = ("layernorm", "mlp", "moe_act")
# The attention kernels the trainer runs: torch's scaled_dot_product_attention, its fused flash
# kernel on CPUs and FlashAttention-2 (or cuDNN / memory-efficient) on GPUs. Under context
# parallelism the ring's blocks are plain matmuls over the scores whatever this says (and are
# priced as "unfused", runtime/summary.py).
TRAINER_ATTENTION = ("flash", "flash2")


def trainer_etps(tp: int) -> tuple[int, ...]:
    """Expert tensor-parallel degrees the trainer runs beside tensor parallel ``tp``: 1 (each
    TP rank runs whole experts on its own sequence shard) or tp (every expert split over the
    TP ranks, runtime/tp.py)."""
    return tuple(sorted({1, tp}))


def _err(field: str, value: object, allowed: str) -> SpecError:
    return SpecError(field, value, allowed)


def trainer_model_refusal(model: ModelSpec) -> SpecError | None:
    """The first [model] field the trainer's decoder (runtime/model.py, RMSNorm, RoPE,
    grouped-query attention, SwiGLU, MoE) would not honour, or None."""
    if model.ffn_activation != "swiglu":
        return _err("model.ffn_activation", model.ffn_activation, "the runtime trains swiglu")
    if model.head_dim not in (None, model.hidden_size // model.num_attention_heads):
        return _err(
            "model.head_dim",
            model.head_dim,
            "the runtime needs head_dim = hidden_size / num_attention_heads",
        )
    if model.attention_window is not None:
        return _err(
            "model.attention_window",
            model.attention_window,
            "the runtime's attention is full causal: leave it unset to train",
        )
    if (model.hidden_size // model.num_attention_heads) % 2:
        return _err(
            "model.hidden_size",
            model.hidden_size,
            "hidden_size / num_attention_heads must be even (RoPE pairs)",
        )
    if model.position_embedding != "rope":
        return _err("model.position_embedding", model.position_embedding, "allowed: rope")
    if model.kv_lora_rank is not None:
        return _err(
            "model.kv_lora_rank",
            model.kv_lora_rank,
            "the runtime has no multi-head latent attention; leave it unset",
        )
    if model.mtp_layers:
        return _err("model.mtp_layers", model.mtp_layers, "the runtime has no MTP; allowed: 0")
    return None


def trainer_training_refusal(training: TrainingSpec) -> SpecError | None:
    """The first [training] field the trainer would not honour, or None."""
    if training.precision not in ("bf16", "fp8"):
        return _err(
            "training.precision",
            training.precision,
            "the runtime trains with bf16 autocast on GPUs (fp32 on CPUs), FP8 linears on "
            "GPUs through torchao; allowed: bf16, fp8",
        )
    if training.optimizer != "adamw":
        return _err("training.optimizer", training.optimizer, "the runtime implements adamw")
    if training.dropout:
        return _err(
            "training.dropout",
            training.dropout,
            "the runtime's decoder has no dropout (Llama-style); allowed: 0",
        )
    if training.attention not in TRAINER_ATTENTION:
        return _err(
            "training.attention",
            training.attention,
            "the runtime runs torch's scaled_dot_product_attention (its flash kernels); "
            "allowed: " + " | ".join(TRAINER_ATTENTION),
        )
    return None


def trainer_plan_refusal(
    plan: ParallelPlan, model: ModelSpec, world_size: int, given_dp: int | None = None
) -> SpecError | None:
    """The first rule of the trainer ``plan`` breaks on ``world_size`` processes, or None.

    ``given_dp``: the run spec's own parallel.dp (None when it leaves dp to the world size)."""
    mp = plan.tp * plan.pp * plan.cp
    if world_size % mp:
        return _err("parallel", f"tp*pp*cp = {mp}", f"must divide the world size {world_size}")
    dp = world_size // mp
    if given_dp is not None and given_dp != dp:
        return _err(
            "parallel.dp",
            given_dp,
            f"tp*pp*cp*dp = {given_dp * mp} must equal the world size {world_size}",
        )
    for check in (_moe_refusal, _layout_refusal, _schedule_refusal):
        problem = check(plan, model, dp)
        if problem is not None:
            return problem
    return None


def _layout_refusal(plan: ParallelPlan, model: ModelSpec, dp: int) -> SpecError | None:
    if plan.offload_layers:
        return _err(
            "parallel.offload_layers",
            plan.offload_layers,
            "the runtime keeps activations on the device; allowed: 0",
        )
    if model.kv_heads % plan.tp:
        return _err(
            "parallel.tp",
            plan.tp,
            f"must divide num_kv_heads {model.kv_heads} in the runtime "
            "(it does not replicate KV heads)",
        )
    if plan.pp > 1 and model.tied_embeddings:
        return _err(
            "parallel.pp",
            plan.pp,
            "tied embeddings live on the first and the last stage; allowed with pp = 1",
        )
    if plan.zero_stage and plan.dp_shard is not None and dp % plan.dp_shard:
        return _err(
            "parallel.dp_shard", plan.dp_shard, f"must divide the data-parallel degree {dp}"
        )
    for name in plan.recompute_modules:
        if name not in TRAINER_RECOMPUTE_MODULES:
            allowed = " | ".join(TRAINER_RECOMPUTE_MODULES)
            return _err("parallel.recompute_modules", name, f"the runtime recomputes: {allowed}")
    per_step = dp * plan.micro_batch_size
    if plan.global_batch_size % per_step:
        return _err(
            "parallel.global_batch_size",
            plan.global_batch_size,
            f"must be a multiple of dp {dp} x micro_batch_size {plan.micro_batch_size} "
            f"= {per_step} (dp = world size / (tp*pp*cp))",
        )
    return None


def _moe_refusal(plan: ParallelPlan, model: ModelSpec, dp: int) -> SpecError | None:
    """Expert parallel is carved out of the data x context parallel ranks (the mesh dimension
    that holds context parallel: replicas under ZeRO 0, the FSDP shard group otherwise)."""
    if not model.is_moe:
        return None  # the spec refuses ep, etp and moe_a2a_overlap for a dense model
    if plan.moe_a2a_overlap not in TRAINER_A2A_OVERLAPS:
        return _err(
            "parallel.moe_a2a_overlap",
            plan.moe_a2a_overlap,
            "the runtime's dispatch and combine run in line with the experts' compute; "
            "allowed: " + " | ".join(TRAINER_A2A_OVERLAPS),
        )
    if plan.etp not in trainer_etps(plan.tp):
        allowed = " | ".join(map(str, trainer_etps(plan.tp)))
        return _err(
            "parallel.etp",
            plan.etp,
            f"the runtime splits experts over the tensor-parallel ranks or none; allowed with "
            f"tp {plan.tp}: {allowed}",
        )
    if plan.etp > 1 and plan.ep > 1:
        return _err(
            "parallel.etp",
            plan.etp,
            f"the runtime splits experts over tensor parallel without expert parallel; allowed "
            f"with ep {plan.ep}: 1",
        )
    for degree in ("cp", "tp"):  # tp: MoE layers see the sequence-parallel shard
        if model.moe_aux_loss_coeff and getattr(plan, degree) > 1:
            return _err(
                f"parallel.{degree}",
                getattr(plan, degree),
                "the sequence-wise balance loss needs whole sequences on a rank; allowed with "
                "model.moe_aux_loss_coeff > 0: 1",
            )
    if model.moe_capacity_factor is not None and (plan.cp > 1 or plan.etp < plan.tp):
        degree = "cp" if plan.cp > 1 else "tp"
        return _err(
            f"parallel.{degree}",
            getattr(plan, degree),
            "token dropping counts each expert's copies per whole sequence (moe_capacity_factor); "
            "allowed with it: cp 1, and tp 1 unless etp = tp",
        )
    if plan.ep == 1:
        return None
    if (dp * plan.cp) % plan.ep:
        return _err(
            "parallel.ep",
            plan.ep,
            f"must divide dp*cp = {dp * plan.cp} (dp = world size / (tp*pp*cp))",
        )
    group = dp * plan.cp if plan.zero_stage == 0 else (plan.dp_shard or dp) * plan.cp
    if group % plan.ep:
        return _err(
            "parallel.ep",
            plan.ep,
            f"must divide dp_shard*cp = {group}: under HSDP the expert-parallel group is carved "
            "out of the FSDP shard group",
        )
    return None


def _schedule_refusal(plan: ParallelPlan, model: ModelSpec, dp: int) -> SpecError | None:
    """What torch.distributed.pipelining's schedules need: enough micro-batches to fill the
    pipeline, two stages per rank for the V schedule, a layer for every stage."""
    if plan.pp == 1:
        return None
    schedule = plan.schedule
    stages = plan.pp * (2 if schedule == "zbv" else plan.vpp)
    if schedule == "zbv" and plan.vpp != 2:
        return _err(
            "parallel.vpp", plan.vpp, "the zbv schedule holds two stages per rank; allowed: 2"
        )
    if schedule != "zbv" and (plan.vpp > 1) != (schedule == "interleaved-1f1b"):
        return _err(
            "parallel.pp_schedule", schedule, "interleaved-1f1b takes vpp > 1, 1f1b vpp = 1"
        )
    if stages > model.num_layers:
        return _err(
            "parallel.pp",
            plan.pp,
            f"{stages} stages need at least as many layers; the model has {model.num_layers}",
        )
    microbatches = plan.global_batch_size // (dp * plan.micro_batch_size)
    if microbatches < plan.pp:
        return _err(
            "parallel.pp",
            plan.pp,
            f"needs at least pp micro-batches per step; the plan has {microbatches} "
            "(global_batch_size / (dp x micro_batch_size))",
        )
    return None


def trainer_compile_refusal(plan: ParallelPlan, training: TrainingSpec) -> SpecError | None:
    """training.compile under tensor parallel, which the trainer refuses (torch 2.13: the
    compiled block hands the tensor-parallel layers' redistribute backward a plain tensor where
    it expects a DTensor gradient, AttributeError '_local_tensor', with and without sequence
    parallel; found on 2 gloo ranks), or None."""
    if training.compile and plan.tp > 1:
        return _err(
            "training.compile",
            True,
            f"compiled blocks under tensor parallel (parallel.tp = {plan.tp}) fail in DTensor's "
            "backward with torch 2.13; allowed with tp > 1: false",
        )
    return None


def trainer_plan_rule(
    model: ModelSpec, training: TrainingSpec, world_size: int
) -> Callable[[ParallelPlan], SpecError | None]:
    """The trainer's refusal of one plan of this model and training on ``world_size``
    processes (None where it runs it): what ``aihpc search --runnable`` keeps plans by."""
    spec_problem = trainer_model_refusal(model) or trainer_training_refusal(training)
    if spec_problem is not None:
        return lambda plan: spec_problem
    return lambda plan: (
        trainer_plan_refusal(plan, model, world_size) or trainer_compile_refusal(plan, training)
    )


def trainer_refusal(
    spec: RunSpec, plan: ParallelPlan | None = None, world_size: int | None = None
) -> SpecError | None:
    """The trainer's first refusal of ``spec`` run with ``plan`` (default: the spec's own) on
    ``world_size`` processes (default: cluster.num_gpus), or None where it runs it."""
    given_dp = spec.parallel.dp if plan is None else None
    plan = spec.plan() if plan is None else plan
    world = spec.cluster.num_gpus if world_size is None else world_size
    return (
        trainer_model_refusal(spec.model)
        or trainer_training_refusal(spec.training)
        or trainer_plan_refusal(plan, spec.model, world, given_dp)
        or trainer_compile_refusal(plan, spec.training)
        or trainer_vision_refusal(spec, plan)  # [model.vision]: runspec/vlm_rules.py
    )
