"""ParallelPlan: *how* it is trained — parallel degrees, sharding, recompute, batch."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from aihpc.runspec._table import check_choice, check_positive, from_table
from aihpc.runspec.cluster import ClusterSpec
from aihpc.runspec.errors import SpecError
from aihpc.runspec.model import ModelSpec

__all__ = [
    "MOE_A2A_OVERLAPS",
    "PP_SCHEDULES",
    "RECOMPUTE",
    "RECOMPUTE_MODULES",
    "ZERO_STAGES",
    "ParallelPlan",
    "PartialPlan",
    "resolve_plan",
    "validate_plan",
]

# none | selective (Korthikanti: the attention core) | op (torchtitan's op-level selective
# checkpointing: every other matmul output and attention outputs kept) | full (layer inputs only)
RECOMPUTE = ("none", "selective", "op", "full")
ZERO_STAGES = (0, 1, 2, 3)
# 1f1b (one stage per rank) | interleaved-1f1b (vpp stages per rank, Narayanan et al. SC'21) |
# zbv (zero-bubble V: two stages per rank, backward split into input and weight passes; Qi et al.,
# "Zero Bubble Pipeline Parallelism", ICLR 2024)
PP_SCHEDULES = ("1f1b", "interleaved-1f1b", "zbv")
# How much of the MoE dispatch/combine all-to-all runs behind compute. none: all of it exposed
# (Megatron-Core's default); 1f1b: Megatron-Core's EP A2A overlap (--overlap-moe-expert-parallel-
# comm / Megatron-Bridge moe_a2a_overlap), the forward of one micro-batch beside the backward of
# another; dualpipe: DeepSeek-V3's DualPipe schedule (arXiv 2412.19437 sec. 3.2.1), the same
# overlap plus its own pipeline bubble.
MOE_A2A_OVERLAPS = ("none", "1f1b", "dualpipe")
# Megatron-Core's fine-grained recompute (--recompute-modules), the parts aihpc prices:
# mla_up_proj (MLA's query and key-value up projections: Q, K, V not kept), moe_act (the experts'
# activation function: its output not kept), layernorm (the norms: their outputs not kept), mlp
# (the dense layers' FFN). Each runs its forward again in the backward.
RECOMPUTE_MODULES = ("mla_up_proj", "moe_act", "layernorm", "mlp")


@dataclass(frozen=True)
class PartialPlan:
    """The ``[parallel]`` table as written: ``None`` = not given (searched, or defaulted)."""

    tp: int | None = None
    pp: int | None = None
    vpp: int | None = None
    cp: int | None = None
    dp: int | None = None
    ep: int | None = None
    etp: int | None = None
    sequence_parallel: bool | None = None
    zero_stage: int | None = None
    recompute: str | None = None
    micro_batch_size: int | None = None
    global_batch_size: int | None = None
    offload_layers: int | None = None
    pp_schedule: str | None = None
    dp_shard: int | None = None
    moe_a2a_overlap: str | None = None
    recompute_modules: list[str] | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.recompute_modules is not None:
            object.__setattr__(self, "recompute_modules", _check_modules(self.recompute_modules))
        for f in (
            "tp",
            "pp",
            "vpp",
            "cp",
            "dp",
            "ep",
            "etp",
            "micro_batch_size",
            "global_batch_size",
            "dp_shard",
        ):
            check_positive(f"parallel.{f}", getattr(self, f))
        check_positive("parallel.offload_layers", self.offload_layers, allow_zero=True)
        if self.pp_schedule is not None:
            check_choice("parallel.pp_schedule", self.pp_schedule, PP_SCHEDULES)
        if self.moe_a2a_overlap is not None:
            check_choice("parallel.moe_a2a_overlap", self.moe_a2a_overlap, MOE_A2A_OVERLAPS)
        if self.zero_stage is not None:
            check_choice("parallel.zero_stage", self.zero_stage, ZERO_STAGES)
        if self.recompute is not None:
            check_choice("parallel.recompute", self.recompute, RECOMPUTE)

    def given(self) -> dict[str, Any]:
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }


@dataclass(frozen=True)
class ParallelPlan:
    """A complete plan: every degree set. ``num_microbatches`` is derived."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    dp: int = 1
    # Expert parallel: the experts of an MoE layer split over ep ranks. Megatron-Core's "parallel
    # folding" (MoE Parallel Folding, arXiv 2504.14960): attention runs on tp x cp x dp ranks,
    # the experts on etp x ep x edp of the same ranks (etp innermost), so ep may span tensor- and
    # context-parallel ranks: etp x ep must divide tp x cp x dp.
    ep: int = 1
    # Expert tensor parallel: each expert's FFN split over etp ranks. Default 1 (Megatron-Core
    # defaults it to tp; every MoE recipe of Megatron-Bridge's performance configs sets 1).
    etp: int = 1
    sequence_parallel: bool = False
    zero_stage: int = 1
    recompute: str = "none"
    micro_batch_size: int = 1
    global_batch_size: int = 1
    # Layers whose saved activations go to host memory during the forward and come back for the
    # backward (Megatron-Core cpu_offloading_num_layers); 0: none.
    offload_layers: int = 0
    pp_schedule: str | None = None  # None: 1f1b, or interleaved-1f1b when vpp > 1
    # HSDP: data-parallel ranks in one ZeRO / FSDP shard group (sharded inside, replicated
    # across groups); None: all dp ranks (plain FSDP / distributed optimizer).
    dp_shard: int | None = None
    moe_a2a_overlap: str = "none"
    # Fine-grained recompute beside ``recompute`` none or selective (RECOMPUTE_MODULES).
    recompute_modules: tuple[str, ...] = ()

    @property
    def expert_dp(self) -> int:
        """Expert data parallel: replicas of each expert shard, tp*cp*dp / (etp*ep)."""
        return max(1, self.tp * self.cp * self.dp // (self.etp * self.ep))

    @property
    def schedule(self) -> str:
        """The pipeline schedule: as given, else 1f1b or (vpp > 1) interleaved-1f1b."""
        return self.pp_schedule or ("interleaved-1f1b" if self.vpp > 1 else "1f1b")

    @property
    def shard_group(self) -> int:
        """Data-parallel ranks that shard the model state between them (ZeRO 1-3)."""
        return self.dp_shard or self.dp

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def num_gpus(self) -> int:
        return self.model_parallel * self.dp

    def layers_per_stage(self, num_layers: int) -> int:
        """Layers on the most loaded pipeline rank: stages may be uneven (torchtitan splits 126
        layers over 8 stages), so the busiest holds ceil(L / (pp*vpp)) per virtual stage."""
        return -(-num_layers // (self.pp * self.vpp)) * self.vpp

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per optimizer step per pipeline (gradient-accumulation steps)."""
        return self.global_batch_size // (self.dp * self.micro_batch_size)

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["dp_shard"] = self.shard_group
        out["pp_schedule"] = self.schedule
        return out


def _derived_dp_error(g: dict, cluster: ClusterSpec, dp: int, mbs: int) -> SpecError:
    """The batch does not divide over a dp the spec did not give: say where dp came from (the
    defaults of the degrees left out) and what chooses them instead."""
    degrees = ", ".join(
        f"{k} {g.get(k, 1)}" + ("" if k in g else " by default") for k in ("tp", "pp", "cp")
    )
    return SpecError(
        "parallel.global_batch_size",
        g["global_batch_size"],
        f"must be a multiple of dp x micro_batch_size = {dp * mbs}; dp {dp} is num_gpus "
        f"{cluster.num_gpus} / ({degrees}): set [parallel] tp / pp / cp / dp, or let "
        "`aihpc search RUN.toml -o plan.toml` choose them",
    )


def resolve_plan(partial: PartialPlan, cluster: ClusterSpec) -> ParallelPlan:
    """Fill the fields ``estimate`` needs from the given ones (defaults in RUN_SPEC.md)."""
    g = partial.given()
    tp, pp, cp = g.get("tp", 1), g.get("pp", 1), g.get("cp", 1)
    mp = tp * pp * cp
    if "dp" not in g and cluster.num_gpus % mp:
        raise SpecError(
            "parallel", f"tp*pp*cp = {mp}", f"must divide cluster.num_gpus {cluster.num_gpus}"
        )
    dp = g.get("dp", cluster.num_gpus // mp)
    mbs = g.get("micro_batch_size", 1)
    if "global_batch_size" not in g:
        raise SpecError(
            "parallel.global_batch_size",
            None,
            "required: sequences per optimizer step (a multiple of dp x micro_batch_size)",
        )
    if "dp" not in g and g["global_batch_size"] % (dp * mbs):
        raise _derived_dp_error(g, cluster, dp, mbs)
    plan = ParallelPlan(
        tp=tp,
        pp=pp,
        vpp=g.get("vpp", 1),
        cp=cp,
        dp=dp,
        ep=g.get("ep", 1),
        etp=g.get("etp", 1),
        sequence_parallel=g.get("sequence_parallel", tp > 1),
        zero_stage=g.get("zero_stage", 1),
        recompute=g.get("recompute", "none"),
        micro_batch_size=mbs,
        global_batch_size=g["global_batch_size"],
        offload_layers=g.get("offload_layers", 0),
        pp_schedule=g.get("pp_schedule"),
        dp_shard=g.get("dp_shard"),
        moe_a2a_overlap=g.get("moe_a2a_overlap", "none"),
        recompute_modules=tuple(g.get("recompute_modules", ())),
    )
    return plan


def plan_problem(plan: ParallelPlan, model: ModelSpec, cluster: ClusterSpec) -> SpecError | None:
    """The first divisibility rule the plan breaks, or None. Rules are those Megatron-LM,
    torchtitan and NeMo enforce at start-up (the search uses the same function), checked in
    this order."""
    p = plan
    checks = (
        lambda: _degree_problem(p, model, cluster),
        lambda: _schedule_problem(p),
        lambda: _shard_problem(p),
        lambda: _sequence_problem(p, model),
        lambda: _recompute_modules_problem(p, model),
        lambda: _moe_problem(p, model),
        lambda: _batch_problem(p),
        lambda: _offload_problem(p, model, cluster) if p.offload_layers else None,
        lambda: _interleave_problem(p),
    )
    for check in checks:
        problem = check()
        if problem is not None:
            return problem
    return None


def _degree_problem(p: ParallelPlan, model: ModelSpec, cluster: ClusterSpec) -> SpecError | None:
    """The degrees against the cluster and the model's heads, FFN and layers."""
    if p.num_gpus != cluster.num_gpus:
        return SpecError(
            "parallel.dp",
            p.dp,
            f"tp*pp*cp*dp = {p.num_gpus} must equal cluster.num_gpus {cluster.num_gpus}",
        )
    if model.num_attention_heads % p.tp:
        return SpecError(
            "parallel.tp", p.tp, f"must divide num_attention_heads {model.num_attention_heads}"
        )
    if model.kv_heads % p.tp and p.tp % model.kv_heads:
        return SpecError(
            "parallel.tp",
            p.tp,
            f"must divide num_kv_heads {model.kv_heads} "
            "(or be a multiple of it, replicating KV heads)",
        )
    if model.ffn_hidden_size % p.tp:
        return SpecError(
            "parallel.tp", p.tp, f"must divide ffn_hidden_size {model.ffn_hidden_size}"
        )
    if p.sequence_parallel and p.tp == 1:
        return SpecError("parallel.sequence_parallel", True, "needs tp > 1")
    if p.pp * p.vpp > model.num_layers:
        return SpecError(
            "parallel.pp",
            p.pp,
            f"pp*vpp = {p.pp * p.vpp} must not exceed num_layers {model.num_layers}",
        )
    if p.vpp > 1 and p.pp == 1:
        return SpecError("parallel.vpp", p.vpp, "interleaving needs pp > 1")
    return None


def _shard_problem(p: ParallelPlan) -> SpecError | None:
    if p.dp_shard is not None and (p.dp % p.dp_shard or (p.zero_stage == 0 and p.dp_shard != p.dp)):
        allowed = f"must divide dp {p.dp}" if p.zero_stage else "HSDP shards state: zero_stage >= 1"
        return SpecError("parallel.dp_shard", p.dp_shard, allowed)
    return None


def _sequence_problem(p: ParallelPlan, model: ModelSpec) -> SpecError | None:
    """The sequence split over context- and (with sequence parallelism) tensor-parallel ranks."""
    if model.seq_length % (2 * p.cp) and p.cp > 1:
        return SpecError(
            "parallel.cp",
            p.cp,
            f"2*cp must divide seq_length {model.seq_length} "
            "(load-balanced causal context parallel)",
        )
    if p.sequence_parallel and (model.seq_length // p.cp) % p.tp:
        return SpecError(
            "parallel.tp",
            p.tp,
            "must divide the per-CP-rank sequence length with sequence_parallel",
        )
    return None


def _recompute_modules_problem(p: ParallelPlan, model: ModelSpec) -> SpecError | None:
    if p.recompute_modules and p.recompute in ("full", "op"):
        return SpecError(
            "parallel.recompute_modules",
            list(p.recompute_modules),
            f'fine-grained recompute goes with recompute = "none" or "selective" '
            f"(recompute is {p.recompute!r})",
        )
    if "mla_up_proj" in p.recompute_modules and not model.is_mla:
        return SpecError("parallel.recompute_modules", "mla_up_proj", "needs an MLA model")
    if "moe_act" in p.recompute_modules and not model.is_moe:
        return SpecError("parallel.recompute_modules", "moe_act", "needs an MoE model")
    return None


def _batch_problem(p: ParallelPlan) -> SpecError | None:
    if p.global_batch_size % (p.dp * p.micro_batch_size):
        return SpecError(
            "parallel.global_batch_size",
            p.global_batch_size,
            f"must be a multiple of dp x micro_batch_size = {p.dp * p.micro_batch_size}",
        )
    return None


def _interleave_problem(p: ParallelPlan) -> SpecError | None:
    if p.vpp > 1 and p.schedule != "zbv" and p.num_microbatches % p.pp:
        return SpecError(
            "parallel.vpp",
            p.vpp,
            f"interleaved 1F1B needs the micro-batch count "
            f"{p.num_microbatches} to be a multiple of pp {p.pp}",
        )
    return None


def _check_modules(value: object) -> tuple[str, ...]:
    if not isinstance(value, list | tuple):
        raise SpecError("parallel.recompute_modules", value, "a list of module names")
    for v in value:
        check_choice("parallel.recompute_modules", v, RECOMPUTE_MODULES)
    return tuple(dict.fromkeys(value))


def _moe_problem(p: ParallelPlan, model: ModelSpec) -> SpecError | None:
    """Megatron-Core's expert-parallel rules (parallel_state.initialize_model_parallel and
    TransformerConfig): experts split evenly over ep; each expert's FFN evenly over etp; the
    expert grid etp x ep folded onto the tp x cp x dp ranks of a pipeline stage (MoE parallel
    folding); sequence parallel with tp > 1; DualPipe needs its two-direction pipeline."""
    if not model.is_moe:
        for f in ("ep", "etp"):
            if getattr(p, f) > 1:
                return SpecError(f"parallel.{f}", getattr(p, f), "needs a mixture-of-experts model")
        if p.moe_a2a_overlap != "none":
            return SpecError(
                "parallel.moe_a2a_overlap", p.moe_a2a_overlap, "needs a mixture-of-experts model"
            )
        return None
    if model.num_experts % p.ep:
        return SpecError(
            "parallel.ep", p.ep, f"EP rule: must divide num_experts {model.num_experts}"
        )
    if model.expert_ffn_hidden_size % p.etp:
        return SpecError(
            "parallel.etp",
            p.etp,
            f"ETP rule: must divide the expert FFN size {model.expert_ffn_hidden_size}",
        )
    attn = p.tp * p.cp * p.dp
    if attn % (p.etp * p.ep):
        return SpecError(
            "parallel.ep",
            p.ep,
            f"EP folding rule: etp x ep = {p.etp * p.ep} must divide tp x cp x dp = {attn}",
        )
    if p.tp > 1 and not p.sequence_parallel:
        return SpecError(
            "parallel.sequence_parallel",
            False,
            "MoE with tensor parallelism needs sequence_parallel (Megatron-Core's rule)",
        )
    if p.moe_a2a_overlap == "dualpipe" and (p.pp < 2 or p.pp % 2 or p.vpp > 1):
        return SpecError(
            "parallel.moe_a2a_overlap",
            "dualpipe",
            f"DualPipe needs an even pp >= 2 and vpp = 1 (pp is {p.pp}, vpp {p.vpp})",
        )
    return None


def _schedule_problem(p: ParallelPlan) -> SpecError | None:
    """The pipeline schedule must fit the stages per rank: 1f1b one, interleaved-1f1b vpp > 1,
    zbv exactly two (its V)."""
    schedule = p.schedule
    if p.pp == 1:
        if schedule == "1f1b":
            return None
        return SpecError("parallel.pp_schedule", schedule, "needs pp > 1")
    wanted = {"1f1b": "vpp = 1", "interleaved-1f1b": "vpp > 1", "zbv": "vpp = 2"}[schedule]
    ok = {"1f1b": p.vpp == 1, "interleaved-1f1b": p.vpp > 1, "zbv": p.vpp == 2}[schedule]
    if not ok:
        return SpecError("parallel.pp_schedule", schedule, f"needs {wanted} (vpp is {p.vpp})")
    return None


def _offload_problem(p: ParallelPlan, model: ModelSpec, cluster: ClusterSpec) -> SpecError | None:
    """Why ``offload_layers`` cannot apply to this plan, or None. Megatron-Core's TransformerConfig
    allows it only without pipeline parallelism and with fewer layers than the model has (and
    without any recompute; aihpc prices selective recompute beside it, not full, which keeps only
    layer inputs). The GPU needs a host-link figure to price the copies."""
    k = p.offload_layers
    if k >= model.num_layers:
        return SpecError(
            "parallel.offload_layers", k, f"must be less than num_layers {model.num_layers}"
        )
    if p.pp > 1:
        return SpecError(
            "parallel.offload_layers",
            k,
            f"offloading is priced without pipeline parallelism (pp = {p.pp}); allowed with pp = 1",
        )
    if p.recompute == "full":
        return SpecError(
            "parallel.offload_layers",
            k,
            'offloading replaces recompute; with recompute = "full" only layer inputs are kept',
        )
    if cluster.gpu.host_link_GBps is None:
        return SpecError(
            "parallel.offload_layers",
            k,
            f"GPU {cluster.gpu.id!r} has no host_link_GBps (GPU-to-host copy bandwidth); "
            "set it in [cluster.gpu_spec] or allowed: 0",
        )
    return None


def validate_plan(plan: ParallelPlan, model: ModelSpec, cluster: ClusterSpec) -> ParallelPlan:
    problem = plan_problem(plan, model, cluster)
    if problem is not None:
        raise problem
    return plan


def partial_from_table(table: dict[str, Any]) -> PartialPlan:
    return from_table(PartialPlan, table, "parallel")
