"""RLSpec: ``[rl]`` and ``[rl.rollout]`` — an RL post-training step (GRPO, PPO, RLOO).

The actor is ``[model]``; its training layout is ``[parallel]`` (on the training pool's GPUs);
``[parallel].global_batch_size`` is the samples of one optimizer step (verl's
``ppo_mini_batch_size`` x n, NeMo-RL's ``train_global_batch_size``). Example::

    [rl]
    algorithm = "grpo"           # grpo | rloo | ppo (adds a critic) | reinforce | remax
    prompts_per_step = 64
    samples_per_prompt = 32
    # generation_batch = 192      # DAPO's dynamic sampling: generate 192 a round, train on 64
    prompt_len = 256             # mean prompt tokens
    response_len = 2900          # mean response tokens
    max_response_len = 3840      # the cap (max_new_tokens): the long tail ends here
    placement = "colocated"      # colocated | disaggregated (rollout_gpus of them generate)
    staleness = 0                # 0: on-policy; k >= 1: rollouts up to k steps behind (async)

    [rl.rollout]
    tp = 2
    gpu_memory_utilization = 0.6

perf/rl prices it (docs/rl.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aihpc.runspec._table import check_choice, check_positive, from_table
from aihpc.runspec.errors import SpecError

__all__ = [
    "ALGORITHMS",
    "BATCHINGS",
    "OFFLOADS",
    "PLACEMENTS",
    "RESPONSE_DISTS",
    "WEIGHT_SYNCS",
    "RLSpec",
    "RolloutSpec",
    "rl_from_table",
]

# grpo: group-relative advantages (DeepSeekMath); rloo: leave-one-out baseline (Ahmadian et al.
# 2024), priced as GRPO; ppo: a critic trained beside the actor and its values computed each step;
# reinforce: critic-free with a batch-wide or no baseline, any samples per prompt (REINFORCE++,
# Hu 2025, and its variants), priced as GRPO; remax: critic-free, its baseline one greedy response
# per prompt generated after the sampled ones (ReMax, Li et al. 2023; verl's gen_max timer),
# priced as a second rollout of prompts_per_step sequences.
ALGORITHMS = ("grpo", "rloo", "ppo", "reinforce", "remax")
# the algorithms whose baseline is the other samples of the same prompt
GROUP_BASELINES = ("grpo", "rloo")
PLACEMENTS = ("colocated", "disaggregated")
# How response lengths spread (perf/infer/rollout.py's LengthDist, every draw cut at the cap):
# fixed: every response response_len long; uniform: evenly round the mean, within [1, cap];
# lognormal: RL's long tail, mean response_len and log-space spread response_sigma.
RESPONSE_DISTS = ("fixed", "uniform", "lognormal")
# auto: cuda_ipc when colocated, nccl otherwise; cuda_ipc: in place on the same GPUs, each GPU
# taking its engine's shard (verl's hybrid engine); nccl: shard to shard from the training ranks
# to the rollout ranks (NeMo-RL's nccl_reshard refit); full: every rollout GPU receives every
# full tensor and keeps its slice (NeMo-RL's default refit through v0.6: Megatron-Bridge's
# export gathers each tensor on every training rank, then IPC when colocated, a broadcast when
# not); storage: written to and read back from the checkpoint file system.
WEIGHT_SYNCS = ("auto", "cuda_ipc", "nccl", "full", "storage")
ROLLOUT_PRECISIONS = ("bf16", "fp8")
# Whose code moves the training state through host memory around the engine's turn on the GPUs
# (perf/rl/switch.py): nemo-rl: NeMo-RL's Megatron switch (the optimizer out and the parameters
# out after the refit, both back for the log-prob passes and the update); verl-megatron,
# verl-fsdp (FSDP1), verl-fsdp2: verl's workers with the actor's param_offload and
# optimizer_offload on (the parameters in and out around each phase, the optimizer around the
# update); slime: slime's --colocate (torch_memory_saver's pinned backup of the optimizer state
# around training, slime's pinned copies of the parameters; the engine's weights discarded and
# re-sent); none: the training state stays on the GPUs (verl with its offloads off) and only the
# engine's weights sleep and wake.
OFFLOADS = ("nemo-rl", "verl-megatron", "verl-fsdp", "verl-fsdp2", "slime", "none")
# How the update's and log-prob passes' micro-batches are formed (perf/rl/batching.py): packed,
# first-fit into bins of micro_batch_size x (prompt + response cap) tokens (NeMo-RL's sequence
# packing, verl's dynamic batching); unpadded, micro_batch_size sequences each, their padding
# removed (verl's default fixed micro-batches); padded, micro_batch_size sequences each padded to
# the step's longest.
BATCHINGS = ("packed", "unpadded", "padded")
# The planner's range. The largest published steps generate ~10^4 samples (NeMo-RL: 2,048;
# verl's DAPO: 512 x 16) of up to ~10^5 tokens; published asynchronous runs stay within 8 steps
# of staleness (NeMo-RL's 8-step off-policy row, AReaL's eta <= 8). Far beyond these the
# rollout simulation (one event per response) would run for minutes, so they are refused.
MAX_SAMPLES = 1 << 17
MAX_TOKENS = 1 << 21
MAX_STALENESS = 64


@dataclass(frozen=True)
class RolloutSpec:
    """``[rl.rollout]``: the inference engines' layout (vLLM / SGLang); dp is derived."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    gpu_memory_utilization: float = 0.6  # vLLM's share of GPU memory (weights + KV cache)
    precision: str = "bf16"
    # decode steps replayed as CUDA graphs (vLLM's enforce_eager off); false: every kernel issued
    # from Python each step (verl's rollout default until August 2025)
    cuda_graphs: bool = True
    # most sequences one engine runs at once (vLLM's max_num_seqs); none: as many as its KV cache
    # holds. vLLM's own default is 1024 on GPUs of >= 70 GiB through its LLM class, 256 below;
    # from vLLM 0.10 an AsyncLLM built without a usage context (NeMo-RL's async_engine) gets 128
    max_num_seqs: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.cuda_graphs, bool):
            raise SpecError("rl.rollout.cuda_graphs", self.cuda_graphs, "true or false")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise SpecError("rl.rollout.max_num_seqs", self.max_num_seqs, "an integer >= 1")
        for f in ("tp", "pp", "ep"):
            value = getattr(self, f)
            if value < 1:
                raise SpecError(f"rl.rollout.{f}", value, "must be an integer >= 1")
        g = self.gpu_memory_utilization
        if not 0 < g <= 1:
            raise SpecError("rl.rollout.gpu_memory_utilization", g, "must be in (0, 1]")
        check_choice("rl.rollout.precision", self.precision, ROLLOUT_PRECISIONS)

    @property
    def gpus_per_engine(self) -> int:
        return self.tp * self.pp


@dataclass(frozen=True)
class RLSpec:
    """``[rl]``: what one RL step generates and trains, and where."""

    prompts_per_step: int
    samples_per_prompt: int
    prompt_len: int
    response_len: int
    max_response_len: int | None = None  # None: response_len (every response as long)
    # DAPO's dynamic sampling: the rollout generates (and scores) generation_batch prompts a
    # round, drops the groups whose rewards all agree, and runs generation_rounds rounds one
    # after another until prompts_per_step groups are kept (verl's recipe.dapo: data.gen_batch_size
    # a round; NeMo-RL: num_prompts_per_step x batch_multiplier). None / 1: one round of
    # prompts_per_step, every generated group trained on.
    generation_batch: int | None = None
    generation_rounds: int = 1
    algorithm: str = "grpo"
    response_dist: str = "lognormal"
    response_sigma: float = 0.8  # lognormal's log-space spread
    ppo_epochs: int = 1  # passes of the update over the step's samples
    kl: bool = True  # a KL term to the reference: its log-probs are computed every step
    reference: str | None = None  # a preset; None: the actor's shape
    critic: str | None = None  # ppo: a preset; None: the actor's shape
    reward: str = "rule"  # rule (verifiable, on CPU) | model (a reward model's forward)
    reward_model: str | None = None  # reward = "model": a preset
    placement: str = "colocated"
    rollout_gpus: int = 0  # disaggregated: GPUs of the rollout pool; the rest train
    staleness: int = 0
    weight_sync: str = "auto"
    # disaggregated: the trainer moves its optimizer state to host memory before the log-prob
    # passes and back before the update, every step (NeMo-RL through v0.4.0 always did:
    # prepare_for_lp_inference ran offload_before_refit; since v0.5.0 its
    # policy.offload_optimizer_for_logprob, default false). Colocated runs move it regardless.
    offload_optimizer_for_logprob: bool = False
    offload: str = "nemo-rl"  # OFFLOADS
    batching: str = "packed"  # BATCHINGS
    # Megatron's variable_seq_lengths: under pipeline parallelism the stages exchange each
    # micro-batch's shape, so it crosses them at its own length (verl and slime always set it);
    # false: every micro-batch padded to the step's longest, a static buffer (NeMo-RL's
    # pad_full_seq_to)
    variable_seq_lengths: bool = False
    rollout: RolloutSpec = field(default_factory=RolloutSpec)

    def __post_init__(self) -> None:
        for f in ("prompts_per_step", "samples_per_prompt", "prompt_len", "response_len"):
            value = getattr(self, f)
            if value < 1:
                raise SpecError(f"rl.{f}", value, "must be an integer >= 1")
        if self.max_response_len is not None and self.max_response_len < 1:
            raise SpecError("rl.max_response_len", self.max_response_len, "must be >= 1")
        self._check_generation()
        check_choice("rl.algorithm", self.algorithm, ALGORITHMS)
        check_choice("rl.response_dist", self.response_dist, RESPONSE_DISTS)
        check_choice("rl.placement", self.placement, PLACEMENTS)
        check_choice("rl.reward", self.reward, ("rule", "model"))
        check_choice("rl.weight_sync", self.weight_sync, WEIGHT_SYNCS)
        check_choice("rl.offload", self.offload, OFFLOADS)
        check_choice("rl.batching", self.batching, BATCHINGS)
        if not isinstance(self.variable_seq_lengths, bool):
            raise SpecError("rl.variable_seq_lengths", self.variable_seq_lengths, "true or false")
        if self.offload_optimizer_for_logprob and self.offload != "nemo-rl":
            raise SpecError(
                "rl.offload_optimizer_for_logprob",
                True,
                f'only with offload = "nemo-rl" (it is "{self.offload}"): NeMo-RL\'s flag',
            )
        check_positive("rl.ppo_epochs", self.ppo_epochs)
        if not 0 <= self.response_sigma <= 4:
            raise SpecError("rl.response_sigma", self.response_sigma, "must be in [0, 4]")
        if not 0 <= self.staleness <= MAX_STALENESS:
            raise SpecError("rl.staleness", self.staleness, f"must be in [0, {MAX_STALENESS}]")
        if self.generated_samples_per_step > MAX_SAMPLES:
            raise SpecError(
                "rl.samples_per_prompt",
                self.samples_per_prompt,
                f"generated prompts x samples_per_prompt = {self.generated_samples_per_step}: "
                f"at most {MAX_SAMPLES} samples a step (the planner's range)",
            )
        for f in ("prompt_len", "response_len", "max_response_len"):
            value = getattr(self, f)
            if value is not None and value > MAX_TOKENS:
                raise SpecError(f"rl.{f}", value, f"at most {MAX_TOKENS} tokens")
        if self.algorithm in GROUP_BASELINES and self.samples_per_prompt < 2:
            raise SpecError(
                "rl.samples_per_prompt",
                self.samples_per_prompt,
                f"{self.algorithm} needs >= 2: its baseline is the other samples of the prompt",
            )
        self._check_lengths()
        self._check_models()
        self._check_placement()

    def _check_generation(self) -> None:
        if self.generation_batch is not None and self.generation_batch < 1:
            raise SpecError("rl.generation_batch", self.generation_batch, "an integer >= 1")
        check_positive("rl.generation_rounds", self.generation_rounds)
        if self.generated_prompts < self.prompts_per_step:
            raise SpecError(
                "rl.generation_rounds" if self.generation_rounds > 1 else "rl.generation_batch",
                self.generation_rounds if self.generation_rounds > 1 else self.generation_batch,
                f"generation_batch x generation_rounds = {self.generated_prompts} must be >= "
                f"rl.prompts_per_step {self.prompts_per_step} (the prompts trained on are some "
                "of those generated)",
            )

    def _check_lengths(self) -> None:
        if self.max_response_len is not None and self.max_response_len < self.response_len:
            raise SpecError(
                "rl.max_response_len",
                self.max_response_len,
                f"must be >= rl.response_len {self.response_len} (the mean)",
            )

    def _check_models(self) -> None:
        if self.reward == "model" and not self.reward_model:
            raise SpecError("rl.reward_model", None, 'required with reward = "model": a preset')
        if self.reward == "rule" and self.reward_model:
            raise SpecError(
                "rl.reward_model", self.reward_model, 'only with reward = "model" (it is "rule")'
            )
        if self.critic and self.algorithm != "ppo":
            raise SpecError(
                "rl.critic", self.critic, f"only ppo trains a critic (algorithm = {self.algorithm})"
            )

    def _check_placement(self) -> None:
        if self.placement == "colocated":
            if self.rollout_gpus:
                raise SpecError(
                    "rl.rollout_gpus",
                    self.rollout_gpus,
                    'only with placement = "disaggregated": colocated pools share every GPU',
                )
            if self.staleness:
                raise SpecError(
                    "rl.staleness",
                    self.staleness,
                    'must be 0 with placement = "colocated": rollout and training take turns on '
                    'the same GPUs, so nothing overlaps (use "disaggregated")',
                )
            if self.weight_sync == "nccl":
                raise SpecError(
                    "rl.weight_sync", "nccl", "colocated: auto | cuda_ipc | full | storage"
                )
        elif self.rollout_gpus < 1:
            raise SpecError(
                "rl.rollout_gpus",
                self.rollout_gpus,
                'required with placement = "disaggregated": the rollout pool\'s GPUs (>= 1)',
            )
        elif self.weight_sync == "cuda_ipc":
            raise SpecError(
                "rl.weight_sync",
                "cuda_ipc",
                "needs the pools on the same GPUs (placement = colocated); here: nccl | full | "
                "storage",
            )

    @property
    def samples_per_step(self) -> int:
        """The samples one step trains on."""
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def round_prompts(self) -> int:
        """The prompts one generation round samples (``generation_batch``, else every trained
        prompt)."""
        return self.generation_batch or self.prompts_per_step

    @property
    def generated_prompts(self) -> int:
        """The prompts one step's rollout generates over its rounds."""
        return self.round_prompts * self.generation_rounds

    @property
    def generated_samples_per_step(self) -> int:
        """The samples one step's rollout generates and scores."""
        return self.generated_prompts * self.samples_per_prompt

    @property
    def response_cap(self) -> int:
        return self.max_response_len or self.response_len

    @property
    def sync_method(self) -> str:
        if self.weight_sync != "auto":
            return self.weight_sync
        return "cuda_ipc" if self.placement == "colocated" else "nccl"

    def pools(self, num_gpus: int) -> tuple[int, int]:
        """(rollout GPUs, training GPUs) of a job of ``num_gpus``."""
        if self.placement == "colocated":
            return num_gpus, num_gpus
        return self.rollout_gpus, num_gpus - self.rollout_gpus

    def check_cluster(self, num_gpus: int, per_node: int, global_batch_size: int | None) -> None:
        """The rules that need the job's size (``per_node`` GPUs a node) and training batch."""
        rollout, train = self.pools(num_gpus)
        if train < 1:
            raise SpecError(
                "rl.rollout_gpus",
                self.rollout_gpus,
                f"must leave GPUs to train: below cluster.num_gpus {num_gpus}",
            )
        for pool in (rollout, train):
            if pool > per_node and pool % per_node:
                raise SpecError(
                    "rl.rollout_gpus",
                    self.rollout_gpus,
                    f"each pool must be whole nodes of {per_node} GPUs (or fit in one): "
                    f"{rollout} rollout + {train} training",
                )
        if rollout % self.rollout.gpus_per_engine:
            raise SpecError(
                "rl.rollout",
                f"tp x pp = {self.rollout.gpus_per_engine}",
                f"must divide the rollout pool's {rollout} GPUs",
            )
        if global_batch_size and self.samples_per_step % global_batch_size:
            raise SpecError(
                "parallel.global_batch_size",
                global_batch_size,
                f"must divide the samples of an RL step, prompts_per_step x samples_per_prompt = "
                f"{self.samples_per_step} (each step's samples make whole optimizer steps)",
            )


def rl_from_table(table: dict[str, Any]) -> RLSpec:
    """``[rl]`` (with ``[rl.rollout]``) read and checked; SpecError names the field."""
    table = dict(table)
    rollout = table.pop("rollout", {})
    if not isinstance(rollout, dict):
        raise SpecError("rl.rollout", rollout, "expected a table ([rl.rollout])")
    return from_table(RLSpec, table, "rl", rollout=from_table(RolloutSpec, rollout, "rl.rollout"))
