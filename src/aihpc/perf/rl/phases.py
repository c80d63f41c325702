"""The phases of an RL step beside the rollout, each from the step model (perf/step):

- training: the actor's update, the existing estimate of the training plan on the training
  pool, once per optimizer step (the step's samples / ``[parallel].global_batch_size``, times
  ``ppo_epochs``), on the micro-batches the trainer forms (perf/rl/batching.py: NeMo-RL's
  sequence packing into bins of micro_batch_size x (prompt + longest response) tokens, one
  bin per micro-batch, round-robin over the data-parallel ranks; the pipeline's bubble over
  that many micro-batches);
- forward-only passes (old-policy and reference log-probs, a critic's values, a reward model):
  one pass over all the step's samples, packed as the update's are, priced as the same plan's
  forward share of such a step: a third of its compute (the forward of the
  forward + backward = 3 x forward FLOPs), half its layer communication (tensor, context,
  expert and pipeline traffic run both ways in training), under ZeRO-3 a third of its data-
  parallel traffic (the forward's parameter all-gather), no recompute, no gradient reduction,
  no optimizer;
- weight sync: the actor's weights from the training layout to the rollout layout.

The colocated switch (training state and engine weights through host memory) is switch.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from aihpc.perf.rl.batching import Batches, batches
from aihpc.perf.step.estimate import Estimate, estimate_plan
from aihpc.perf.step.flops import num_params
from aihpc.perf.step.params import DEFAULT_PARAMS, ModelParams
from aihpc.runspec.cluster import ClusterSpec
from aihpc.runspec.errors import SpecError
from aihpc.runspec.model import ModelSpec
from aihpc.runspec.parallel import ParallelPlan
from aihpc.runspec.rl import RLSpec
from aihpc.runspec.training import TrainingSpec

__all__ = [
    "Training",
    "batched",
    "forward_s",
    "full_sync_bytes_s",
    "packed_model",
    "price_training",
    "reference_swap_s",
    "sync_bytes",
    "sync_s",
]

_LAYER_COMM = ("tp_comm", "cp_comm", "ep_comm", "pp_comm")


@dataclass(frozen=True)
class Training:
    """The training plan priced on a step's samples."""

    estimate: Estimate  # one optimizer step on its packed micro-batches
    optimizer_steps: int  # per RL step (ppo_epochs included)
    forward: Estimate  # the plan on one pass over all the step's samples (forward share used)
    batches: Batches  # the update's micro-batches (one optimizer step)

    @property
    def update_s(self) -> float:
        return self.estimate.step_time_s * self.optimizer_steps

    @property
    def forward_s(self) -> float:
        return forward_s(self.forward)


def forward_s(e: Estimate) -> float:
    """One optimizer step's batch through the forward only (log-probs, values, rewards). Under
    ZeRO-3 / FSDP the forward gathers the parameters as training does: one of its three equal
    collectives (forward all-gather, backward all-gather, gradient reduce-scatter)."""
    t = e.time_s
    compute = max(0.0, t.get("compute", 0.0)) / 3.0
    comm = sum(t.get(k, 0.0) for k in _LAYER_COMM) / 2.0
    bubble = t.get("pipeline_bubble", 0.0) / 3.0
    gather = t.get("dp_comm", 0.0) / 3.0 if e.plan.zero_stage == 3 else 0.0
    return compute + comm + bubble + gather


def packed_model(model: ModelSpec, rl: RLSpec, plan: ParallelPlan) -> ModelSpec:
    """The model with sequences of a full packed bin (prompt + longest response: one
    micro-batch's most tokens), padded to a multiple of 2 x cp x tp: the probe the search ranks
    training plans with, so that the plans it keeps hold a full bin's activations (the step
    itself is priced on the packed micro-batches, ``price_training``)."""
    unit = 2 * plan.cp * plan.tp
    seq = -(-(rl.prompt_len + rl.response_cap) // unit) * unit
    return replace(model, seq_length=seq)


def batched(model: ModelSpec, plan: ParallelPlan, b: Batches) -> tuple[ModelSpec, ParallelPlan]:
    """The model and plan the step model prices ``b``'s micro-batches with: sequences of
    ``b.seq`` tokens, ``b.mbs`` to a micro-batch, ``b.microbatches`` per data-parallel rank."""
    return (
        replace(model, seq_length=b.seq),
        replace(plan, micro_batch_size=b.mbs, global_batch_size=b.global_batch(plan.dp)),
    )


def price_training(
    model: ModelSpec,
    cluster: ClusterSpec,
    plan: ParallelPlan,
    training: TrainingSpec,
    rl: RLSpec,
    params: ModelParams = DEFAULT_PARAMS,
    batching: str = "packed",
) -> Training:
    """The actor (or critic) trained under ``plan`` on ``cluster`` (the training pool), its
    samples batched as ``batching`` says (perf/rl/batching.py)."""
    gbs = min(plan.global_batch_size, rl.samples_per_step)
    update = batches(rl, plan, gbs, batching)
    m, p = batched(model, plan, update)
    est = estimate_plan(m, cluster, p, training, params)
    passes = batches(rl, plan, rl.samples_per_step, batching)
    m, p = batched(model, plan, passes)
    fwd = estimate_plan(m, cluster, p, training, params)
    steps = max(1, rl.samples_per_step // plan.global_batch_size)
    return Training(est, steps * rl.ppo_epochs, fwd, update)


def sync_bytes(model: ModelSpec, rl: RLSpec) -> float:
    """The actor's weights as the rollout engines hold them."""
    return num_params(model) * (1.0 if rl.rollout.precision == "fp8" else 2.0)


# Eager host ops one weight tensor costs on its way into a rollout engine: the view of the
# source shard, the transfer call (a NCCL broadcast / receive or a CUDA-IPC handle), the view
# the engine's weight loader takes of its own shard and the copy into its parameter; each at
# ModelParams.host_eager_op_s. vLLM and SGLang load weights one checkpoint-named tensor at a
# time (a MoE layer's experts are 3 x E tensors), so the count, not only the bytes, matters.
SYNC_OPS_PER_TENSOR = 4


def checkpoint_tensors(model: ModelSpec) -> int:
    """Tensors of the model as a Hugging Face checkpoint names them (what an engine's weight
    loader takes one by one): per layer the attention projections (q, k, v, o; MLA's q_a, q_b,
    kv_a, kv_b, o), two norms, and either the MLP's three or the router and three per routed
    and shared expert; the embedding, the output layer and the final norm."""
    attention = 5 if model.is_mla else 4
    dense = 3
    moe = 1 + 3 * (model.num_experts + model.num_shared_experts)
    layers = (model.num_layers - model.num_moe_layers) * (attention + 2 + dense)
    layers += model.num_moe_layers * (attention + 2 + moe)
    return layers + 3


def sync_s(
    model: ModelSpec,
    cluster: ClusterSpec,
    rl: RLSpec,
    train_gpus: int,
    params: ModelParams = DEFAULT_PARAMS,
    plan: ParallelPlan | None = None,
) -> float:
    """Seconds to move the updated weights into the rollout engines: the bytes over the fabric
    below, plus the host cost of handing over each checkpoint tensor (SYNC_OPS_PER_TENSOR eager
    ops each), which the ranks of an engine pay side by side.

    cuda_ipc (colocated): each GPU gathers its engine's shard from the training shards beside it
    over the scale-up fabric (NVLink) where an engine fits in one domain, else the NIC.
    nccl (disaggregated): each rollout GPU receives its engine's shard over its NIC while the
    training GPUs send every engine a copy, fanned out by a pipelined broadcast: the slower of
    the rollout side's receive and the training side's send.
    full: every rollout GPU receives the whole model and its loader keeps its slice
    (``full_sync_bytes_s``; ``plan``: the training plan, whose shards a colocated GPU gathers).
    storage: the weights written by the training pool and read by every engine."""
    host = checkpoint_tensors(model) * SYNC_OPS_PER_TENSOR * params.host_eager_op_s
    if rl.sync_method == "full":
        return host + full_sync_bytes_s(model, cluster, rl, train_gpus, plan)
    return host + _sync_bytes_s(model, cluster, rl, train_gpus)


def full_sync_bytes_s(
    model: ModelSpec,
    cluster: ClusterSpec,
    rl: RLSpec,
    train_gpus: int,
    plan: ParallelPlan | None = None,
) -> float:
    """Seconds for every rollout GPU to receive every full tensor (``weight_sync = "full"``).

    Disaggregated: the training side broadcasts each full tensor to every rollout GPU, which
    receives the whole model over its NIC. Colocated: the exporter gathers each full tensor on
    every training rank (a broadcast from the pipeline stage that owns it, all-gathers over
    the tensor- and expert-parallel ranks) and hands it to the engine on the same GPU: a GPU
    receives the whole model less the shard it trains, from the ranks that hold the rest --
    over NVLink where they share its scale-up domain, else at its NIC's rate. The ranks holding
    distinct shards: ``pp`` stages of max(tp, etp x ep) ranks; pipeline stages are the
    outermost ranks, so with pp > 1 they span the training pool."""
    total = sync_bytes(model, rl)
    nic = cluster.scale_out_bw_GBps * 1e9
    if rl.placement != "colocated":
        return total / nic
    plan = plan or ParallelPlan()
    within = max(plan.tp, plan.etp * plan.ep if model.is_moe else 1)
    holders = plan.pp * within
    span = train_gpus if plan.pp > 1 else within
    fabric = cluster.scale_up_bw_GBps * 1e9 if span <= cluster.nvlink_domain else nic
    return total * (1.0 - 1.0 / holders) / fabric


def _sync_bytes_s(model: ModelSpec, cluster: ClusterSpec, rl: RLSpec, train_gpus: int) -> float:
    total = sync_bytes(model, rl)
    r = rl.rollout
    shard = total / r.gpus_per_engine
    method = rl.sync_method
    if method == "cuda_ipc":
        fabric = cluster.scale_up_bw_GBps if r.gpus_per_engine <= cluster.nvlink_domain else None
        return shard / ((fabric or cluster.scale_out_bw_GBps) * 1e9)
    rollout_gpus = rl.pools(cluster.num_gpus)[0]
    engines = max(1, rollout_gpus // r.gpus_per_engine)
    if method == "nccl":
        receive = shard / (cluster.scale_out_bw_GBps * 1e9)
        send = total / (train_gpus * cluster.scale_out_bw_GBps * 1e9)
        return max(receive, send)
    write, read = cluster.storage_write_bw_GBps, cluster.storage_read_bw_GBps
    if write is None or read is None:
        raise SpecError(
            "rl.weight_sync",
            "storage",
            "needs cluster.storage_write_bw_GBps and storage_read_bw_GBps (the file system's)",
        )
    return total / (write * 1e9) + total * engines / (read * 1e9)


def reference_swap_s(train: Estimate, cluster: ClusterSpec, copies: float = 3.0) -> float:
    """Seconds to swap the reference policy in for its log-prob pass and out again, as NeMo-RL
    does (megatron_policy_worker.use_reference_model: the reference's weights live in host
    memory; the policy's own 16-bit weights are copied to the host, the reference's loaded onto
    the GPU, and after the pass the policy's loaded back): three copies of each GPU's weights
    over its host link, at the pinned-memory rate: the copies are pinned (``.to("cpu",
    non_blocking=True)``, whose output PyTorch's ``_to_copy`` allocates pinned, for the policy's
    copy and for the reference's, made once at start-up). slime (``copies`` 2) keeps the
    policy's pinned copy from its update, so it swaps the reference in and the policy back. 0
    where the GPU names no host_link_GBps."""
    link = cluster.gpu.host_link_GBps
    if link is None:
        return 0.0
    return copies * train.memory.weights / (link * 1e9)
