"""TrainingSpec: numerics, optimizer and the trainer's schedule; CheckpointSpec for the runtime."""

from __future__ import annotations

import math
from dataclasses import dataclass

from aihpc.runspec._table import check_choice, check_positive
from aihpc.runspec.cluster import PRECISIONS
from aihpc.runspec.errors import SpecError

__all__ = [
    "ATTENTION",
    "COMM_CTA_CAPS",
    "CP_EXCHANGES",
    "CROSS_ENTROPY",
    "CUDA_GRAPHS",
    "DEFAULT_IN_PROCESS_RESTARTS",
    "DTENSOR_DISPATCH",
    "DTYPE_BYTES",
    "FP8_SAVED_INPUTS",
    "MOE_DISPATCHERS",
    "MOE_DISPATCH_DTYPES",
    "MOE_EXPERT_GEMMS",
    "MOE_STACKS",
    "MOE_STACK_DISPATCHER",
    "OPTIMIZERS",
    "PARAM_DTYPES",
    "PIPELINE_SPLITS",
    "STATE_DTYPES",
    "TP_COMM_OVERLAPS",
    "ZERO3_GATHERS",
    "CheckpointSpec",
    "TrainingSpec",
]

OPTIMIZERS = ("adamw", "adam", "sgd")
ATTENTION = ("flash", "flash2", "flex", "triton", "flash1", "unfused")
STATE_DTYPES = ("fp32", "bf16", "fp16")
# The dtype FSDP2 gathers parameters in and computes with (its MixedPrecisionPolicy param_dtype).
# auto: bf16 on GPUs (what the planner prices: 16-bit gathers), fp32 on CPUs (the CPU trainer
# computes in fp32: autocast to bf16 made a tiny model's CPU step 15x slower, runtime/loop.py).
PARAM_DTYPES = ("auto", "bf16", "fp32")
DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0}
ZERO3_GATHERS = ("bucketed", "per_tensor")
CP_EXCHANGES = ("ring", "allgather")
# How a framework overlaps tensor-parallel collectives with GEMMs (perf/step/tp_overlap.py prices
# each); the first is the default.
TP_COMM_OVERLAPS = ("backward", "none", "userbuffers", "async_tp")
PIPELINE_SPLITS = ("uneven", "even", "balanced")
FP8_SAVED_INPUTS = ("fp8", "bf16", "deepseek")
CROSS_ENTROPY = ("fused", "vocab_parallel", "eager")
MOE_DISPATCHERS = ("alltoall", "hierarchical")
MOE_DISPATCH_DTYPES = ("bf16", "fp8")
MOE_EXPERT_GEMMS = ("grouped", "per_expert")
CUDA_GRAPHS = ("unknown", "none", "partial", "full")
# The software that runs an MoE layer (perf/step/moe_stack.py; its figures and their sources in
# perf/step/data/moe_stacks.toml): framework-dispatcher. unknown: not stated, priced from
# moe_dispatcher and the link efficiencies as before the fact existed.
MOE_STACKS = (
    "unknown",
    "megatron-alltoall",
    "megatron-allgather",
    "megatron-deepep",
    "megatron-hybridep",
    "torch-native",
    "torch-deepep",
    "torch-hybridep",
    "deepspeed-moe",
)
# The moe_dispatcher each stack runs (a spec that names both must agree).
MOE_STACK_DISPATCHER = {
    "megatron-alltoall": "alltoall",
    "megatron-allgather": "alltoall",
    "megatron-deepep": "hierarchical",
    "megatron-hybridep": "hierarchical",
    "torch-native": "alltoall",
    "torch-deepep": "hierarchical",
    "torch-hybridep": "hierarchical",
    "deepspeed-moe": "alltoall",
}
# Stacks whose dispatch always waits on the host for the routed token counts, so a whole-
# iteration CUDA graph cannot hold an MoE layer: DeepEP's normal kernels ("the CPU will wait for
# GPU's signal to arrive, so this is not compatible with CUDA graph", deepseek-ai/DeepEP
# docs/legacy.md), torchtitan's all_to_all_single splits (.tolist()), DeepSpeed-MoE (eager).
# Megatron-Core's alltoall dispatcher syncs on its split sizes only when dropless: padded to
# capacity (--moe-pad-expert-input-to-capacity) its shapes are static and it graphs.
_HOST_SYNC_STACKS = (
    "megatron-deepep",
    "torch-native",
    "torch-deepep",
    "deepspeed-moe",
)
DTENSOR_DISPATCH = ("none", "eager")
# The [training] fields that cap a communicator's NCCL CTAs (point-to-point transfers only).
COMM_CTA_CAPS = ("cp_comm_ctas", "pp_comm_ctas")


@dataclass(frozen=True)
class TrainingSpec:
    """``[training]``. The planner reads precision and optimizer; the trainer reads all of it."""

    precision: str = "bf16"  # bf16 | fp16 | fp8 (fp8 GEMMs, bf16 elsewhere)
    optimizer: str = "adamw"
    # flash: the best fused attention kernel for the GPU (FlashAttention-3 / cuDNN / Transformer
    # Engine on Hopper and newer, FlashAttention-2 on Ampere); flash2: FlashAttention-2 kernels
    # (PyTorch SDPA's flash backend) on any part; flex: FlexAttention (torch.compile-generated
    # Triton, PyTorch 2.5+); triton: FlashAttention in Triton (flash-attn's flash_attn_triton,
    # llm-foundry's attn_impl "triton", 2022-2023); flash1: FlashAttention 1 or xformers'
    # memory-efficient CUTLASS kernels (2022-2023, e.g. LLaMA 1); unfused: scores, softmax and
    # dropout materialised (Megatron-LM before 2023). None of the fused ones stores the s x s
    # scores. perf/step/attention_kernels.py prices each.
    attention: str = "flash"
    # true: element-wise ops fused (Megatron/TE kernels, torch.compile); false: eager PyTorch,
    # one kernel per op (RMSNorm in fp32, RoPE via complex multiply), which moves more bytes.
    fused_kernels: bool = True
    # The loss kernel. fused: Megatron-Core's fused vocab-parallel cross-entropy
    # (--cross-entropy-loss-fusion; NeMo cross_entropy_loss_fusion); vocab_parallel: Megatron's
    # unfused one, several passes in place over an fp32 copy of the logits (its default);
    # eager: F.cross_entropy on fp32-upcast logits (torchtitan 2024), which keeps more fp32 copies.
    cross_entropy: str = "fused"
    dropout: float = 0.0  # hidden/attention dropout probability (GPT-3-era runs used 0.1)
    # Gradient buffer accumulated and reduced across data-parallel ranks: fp32 (Megatron-LM forces
    # it for bf16, FSDP2 reduce_dtype in torchtitan), bf16 (NeMo grad_sync_dtype=bf16) or fp16.
    grad_reduce_dtype: str = "fp32"
    # Master weights and Adam moments: fp32 (mixed-precision default) or bf16 (NeMo optim.dtype,
    # Megatron's precision-aware optimizer). The planner reads both; the CPU trainer runs in fp32.
    optimizer_dtype: str = "fp32"
    # true: the gradient reduction runs behind the backward (PyTorch DDP buckets, FSDP, Megatron-
    # Core --overlap-grad-reduce, NeMo overlap_grad_sync); false: after the whole backward
    # (Megatron-LM's local DDP before Megatron-Core, e.g. its 2021-2022 papers' runs).
    grad_reduce_overlap: bool = True
    # How ZeRO-3 moves parameters. bucketed: one flat all-gather per layer, prefetched behind
    # compute (FSDP, FSDP2, later DeepSpeed). per_tensor: DeepSpeed 0.3's ZeRO-3, which gathers
    # every parameter tensor on its own after a device synchronize (nothing overlaps) with
    # list-based collectives that, in PyTorch < 1.10, copy each of the n partitions with its own
    # kernel, and reduce-scatters gradients per tensor the same way.
    zero3_gather: str = "bucketed"
    # How context parallelism moves K/V. ring: each rank passes its K/V chunk to the next while
    # it computes a block (Megatron-Core / Transformer Engine's p2p ring; backward also passes
    # dK/dV). allgather: K/V all-gathered once per attention call, hidden only behind the first
    # block, and dK/dV passed around the ring in fp32 by all-to-all after every block (PyTorch's
    # experimental context_parallel, torchtitan's default rotate method in 2024-2025).
    cp_exchange: str = "ring"
    # How tensor-parallel collectives overlap the GEMMs (perf/step/tp_overlap.py). backward: the
    # column linears' input-gradient reduction runs beside their weight-gradient GEMM, nothing
    # else (Megatron-LM since September 2021, Megatron-Core, Transformer Engine without comm
    # overlap). none: nothing overlaps (Megatron-LM before its async all-reduce, PyTorch's
    # DTensor TP, whose reduce-scatter is issued after the weight-gradient matmul). userbuffers:
    # Transformer Engine's comm-GEMM overlap, forward and backward (Megatron-Core
    # --tp-comm-overlap, NeMo ub_tp_comm_overlap). async_tp: PyTorch's micro-pipelined
    # all-gather-matmul / matmul-reduce-scatter (torchtitan enable_async_tensor_parallel).
    tp_comm_overlap: str = "backward"
    # true: K/V repeated to every query head before the attention kernel (torchtitan's repeat_kv
    # ahead of SDPA, 2024), so context parallelism moves num_attention_heads of K/V, not kv_heads.
    kv_repeat: bool = False
    # Most CTAs (NCCL channels) the context-parallel communicator may use; 0: NCCL's default.
    # NVIDIA's Megatron/NeMo recipes cap it to keep SMs for compute: MLPerf Training v5.1's Llama
    # 3.1 8B and 405B configs set `cp: max_ctas: 1` in conf/nccl/custom_communicator_cta.yaml
    # (Megatron-Core `nccl_communicator_config_path`, NCCL `ncclConfig_t.maxCTAs`). One channel
    # moves p2p_channel_bw_GBps of the GPU over NVLink (docs/performance-model.md).
    cp_comm_ctas: int = 0
    # The same cap on the pipeline communicator (stage-to-stage sends); the recipes above set
    # `pp: max_ctas: 2`. Only point-to-point transfers are capped: a ring collective's channel
    # moves more than a p2p channel (NCCL sizes ring channels by its topology search), so the
    # `dp` / `tp: max_ctas: 8` of the same files are not priced.
    pp_comm_ctas: int = 0
    # How layers may be split into pipeline chunks (pp x vpp of them). uneven: chunks may differ
    # by a layer and the busiest is priced (torchtitan's split points; Llama 3's stack runs 126
    # layers on 16 x V chunks). even: every chunk holds the same number of layers, as Megatron-LM,
    # Megatron-Core (arguments.py at core_v0.8.0 asserts it) and NeMo require. balanced: the
    # embedding and the loss count as one layer each in the split, so the last stage holds one
    # layer fewer beside the output layer (Megatron-Core's account_for_embedding/loss_in_pipeline_
    # split and custom pipeline layouts).
    pipeline_split: str = "uneven"
    # What an FP8 linear layer keeps of its input for the backward (precision = "fp8"). fp8:
    # the FP8 cast, 1 byte per value (Transformer Engine: Megatron, NeMo). bf16: the 16-bit input,
    # cast again in the backward (torchao's Float8Linear, torchtitan). deepseek: DeepSeek-V3's
    # low-precision caching (report sec. 3.3.3): fp8's, and the MoE SwiGLU inputs cached in FP8
    # too, the attention output kept once in E5M6 (1.5 bytes) for both the output projection's
    # weight gradient and the attention backward.
    fp8_saved_inputs: str = "fp8"
    # true: data-parallel parameter gathers move the layers' linear weights in FP8, 1 byte per
    # parameter instead of 2 (precision = "fp8"): Megatron/NeMo FP8 parameters (`fp8_params`,
    # `--fp8-param-gather`) behind the distributed optimizer, torchao's
    # `enable_fsdp_float8_all_gather` under FSDP2. Embeddings and the output layer stay 16-bit.
    fp8_param_gather: bool = False
    # How MoE tokens reach their experts. alltoall: one flat all-to-all over the EP group, every
    # routed copy sent on its own (Megatron-Core's alltoall token dispatcher, NCCL). hierarchical:
    # a token crosses the network once per destination node and is forwarded over NVLink inside
    # it (DeepEP's normal kernels, Megatron-Core's flex dispatcher with DeepEP or HybridEP).
    moe_dispatcher: str = "alltoall"
    # Bytes per value of the dispatched tokens: bf16, or fp8 (DeepSeek-V3 quantizes before the
    # dispatch, sec. 3.3.2; the combine stays bf16).
    moe_dispatch_dtype: str = "bf16"
    # Tokens on the busiest expert-parallel rank over the balanced share (>= 1). 1: balanced, as
    # the published benchmarks force (Megatron-Core --moe-router-force-load-balancing).
    moe_imbalance: float = 1.0
    # How the local experts' GEMMs run. grouped: one grouped-GEMM kernel per projection (CUTLASS
    # or cuBLASLt grouped GEMM, DeepGEMM, torch grouped_mm). per_expert: one GEMM launch per local
    # expert, its input split and (FP8) quantized per expert, after the token counts are read on
    # the host (Transformer Engine's GroupedLinear on its cuBLAS path, Megatron-Core's
    # TEGroupedMLP; SequentialMLP). See perf/step/moe_kernels.py.
    moe_expert_gemm: str = "grouped"
    # Whether the run captured its layers in CUDA graphs. none: eager, every op issued from
    # Python each micro-batch, so an MoE layer, which waits on the host for its token counts,
    # runs no faster than the host issues it (perf/step/moe_host.py; Megatron-Core without
    # --cuda-graph-impl). partial: some scopes graphed (Megatron-Core's --cuda-graph-scope attn
    # moe_router moe_preprocess), full: the whole iteration; unknown: not stated. Only none is
    # priced (the host term); the others price the GPU's kernels alone, as before the term.
    cuda_graphs: str = "unknown"
    # Which software runs the MoE layer (MOE_STACKS): its dispatcher, the kernels that move the
    # tokens (each priced at its own published bandwidth on the fabric it reaches), and its host
    # costs. See perf/step/moe_stack.py and docs/moe.md ("The MoE layer, term by term").
    moe_stack: str = "unknown"
    # How ops on DTensors run. none: no DTensor in the step (Megatron-Core), or traced away by
    # torch.compile (torchtitan's compiled blocks). eager: PyTorch-native tensor parallel and
    # FSDP2 run eagerly, so every op on a DTensor (a TP layer's, the loss parallel's, the
    # optimizer's on DTensor parameters) goes through DTensor's Python dispatch in every
    # micro-batch: aihpc's own trainer. perf/step/dtensor_host.py prices that host time.
    dtensor_dispatch: str = "none"
    # true: each decoder block compiled by torch.compile (Inductor), as torchtitan compiles its
    # blocks: element-wise ops fused, one Python call per block instead of one per op. The
    # trainer applies it after tensor parallel and activation checkpointing, before FSDP2
    # (runtime/speed.py); the planner prices fused element-wise kernels and the compiled
    # block's host issue (perf/step/host_issue.py). Needs a C compiler.
    compile: bool = False
    # FSDP2's parameter dtype (all-gathers and compute): auto, bf16 or fp32 (PARAM_DTYPES). The
    # gradient reduction's dtype is grad_reduce_dtype (FSDP2's reduce_dtype).
    param_dtype: str = "auto"
    # true: the run computes the L2 norm of every parameter each iteration (Megatron's
    # --log-params-norm): a frozen bf16 parameter is copied to fp32 first. Priced as memory
    # traffic by perf/step/params_norm.py; aihpc's trainer does not compute it.
    log_params_norm: bool = False
    # true: the run sets torch.use_deterministic_algorithms(True) (Megatron's
    # --deterministic-mode), so PyTorch fills every tensor its empty kernel returns with NaN
    # (fill_uninitialized_memory, on by default): each output Transformer Engine allocates is
    # written twice. Priced as memory traffic by perf/step/deterministic_fill.py (the VLM
    # estimate) and perf/step/params_norm.py; aihpc's trainer does not set it.
    deterministic: bool = False
    train_steps: int = 100
    learning_rate: float = 3e-4
    min_lr_ratio: float = 0.1  # cosine decays to learning_rate * min_lr_ratio
    warmup_steps: int = 10
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    seed: int = 1234
    log_interval: int = 1

    def __post_init__(self) -> None:
        check_choice("training.precision", self.precision, PRECISIONS)
        check_choice("training.optimizer", self.optimizer, OPTIMIZERS)
        check_choice("training.attention", self.attention, ATTENTION)
        check_choice("training.grad_reduce_dtype", self.grad_reduce_dtype, STATE_DTYPES)
        check_choice("training.optimizer_dtype", self.optimizer_dtype, STATE_DTYPES)
        check_choice("training.zero3_gather", self.zero3_gather, ZERO3_GATHERS)
        check_choice("training.cross_entropy", self.cross_entropy, CROSS_ENTROPY)
        check_choice("training.cp_exchange", self.cp_exchange, CP_EXCHANGES)
        check_choice("training.tp_comm_overlap", self.tp_comm_overlap, TP_COMM_OVERLAPS)
        check_choice("training.pipeline_split", self.pipeline_split, PIPELINE_SPLITS)
        check_choice("training.fp8_saved_inputs", self.fp8_saved_inputs, FP8_SAVED_INPUTS)
        check_choice("training.moe_dispatcher", self.moe_dispatcher, MOE_DISPATCHERS)
        check_choice("training.moe_dispatch_dtype", self.moe_dispatch_dtype, MOE_DISPATCH_DTYPES)
        check_choice("training.moe_expert_gemm", self.moe_expert_gemm, MOE_EXPERT_GEMMS)
        check_choice("training.cuda_graphs", self.cuda_graphs, CUDA_GRAPHS)
        self._check_moe_stack()
        check_choice("training.dtensor_dispatch", self.dtensor_dispatch, DTENSOR_DISPATCH)
        check_choice("training.param_dtype", self.param_dtype, PARAM_DTYPES)
        if not (math.isfinite(self.moe_imbalance) and self.moe_imbalance >= 1):
            check_choice("training.moe_imbalance", self.moe_imbalance, ["a number >= 1"])
        if self.fp8_param_gather and self.precision != "fp8":
            raise SpecError(
                "training.fp8_param_gather", self.fp8_param_gather, 'needs precision = "fp8"'
            )
        if not 0 <= self.dropout < 1:
            check_choice("training.dropout", self.dropout, ["a number in [0, 1)"])
        check_positive("training.train_steps", self.train_steps)
        check_positive("training.learning_rate", self.learning_rate)
        check_positive("training.warmup_steps", self.warmup_steps, allow_zero=True)
        check_positive("training.weight_decay", self.weight_decay, allow_zero=True)
        check_positive("training.grad_clip", self.grad_clip, allow_zero=True)
        check_positive("training.log_interval", self.log_interval)
        for f in COMM_CTA_CAPS:
            check_positive(f"training.{f}", getattr(self, f), allow_zero=True)
        if not 0 <= self.min_lr_ratio <= 1:
            check_choice("training.min_lr_ratio", self.min_lr_ratio, ["a number in [0, 1]"])
        for beta in ("adam_beta1", "adam_beta2"):  # what torch.optim.AdamW accepts
            if not 0 <= getattr(self, beta) < 1:
                check_choice(f"training.{beta}", getattr(self, beta), ["a number in [0, 1)"])
        if not -(2**63) <= self.seed < 2**64:  # torch.manual_seed's range
            check_choice("training.seed", self.seed, ["an integer in [-2**63, 2**64)"])

    def _check_moe_stack(self) -> None:
        """moe_stack is a known stack, agrees with moe_dispatcher where both are named, and a
        stack that waits on the host for its token counts cannot run under full CUDA graphs."""
        check_choice("training.moe_stack", self.moe_stack, MOE_STACKS)
        if self.moe_stack == "unknown":
            return
        runs = MOE_STACK_DISPATCHER[self.moe_stack]
        if self.moe_dispatcher not in (runs, "alltoall"):  # alltoall is the field's default
            raise SpecError(
                "training.moe_dispatcher",
                self.moe_dispatcher,
                f'moe_stack "{self.moe_stack}" dispatches {runs}: leave moe_dispatcher unset '
                f"or set it to {runs!r}",
            )
        if self.cuda_graphs == "full" and self.moe_stack in _HOST_SYNC_STACKS:
            raise SpecError(
                "training.cuda_graphs",
                self.cuda_graphs,
                f'moe_stack "{self.moe_stack}" waits on the host for its token counts, so no '
                'whole-iteration CUDA graph holds its MoE layers: "full" needs a sync-free '
                'dispatcher (megatron-hybridep); use "partial" or "none"',
            )


# In-process restarts per launch when ``[checkpoint] in_process_restarts`` is unset, where safe:
# an exception a rerun would repeat (a bug) costs this many quick restarts (about a
# second each on the tiny CPU runs: benchmarks/results/recovery_time.md) before the job fails
# as it would have at once.
DEFAULT_IN_PROCESS_RESTARTS = 2


@dataclass(frozen=True)
class CheckpointSpec:
    """``[checkpoint]``: how the runtime checkpoints (aihpc.resilience)."""

    interval_steps: int = 50
    keep_last: int = 3
    async_save: bool = True
    # the in-memory tier (aihpc.resilience.memory): 0 = off
    memory_interval_steps: int = 0
    memory_max_GiB: float = 8.0  # per rank: its own copy plus the peer replica it holds
    # exceptions / hangs recovered without respawning, per launch; None (unset): automatic,
    # ``DEFAULT_IN_PROCESS_RESTARTS`` where it is safe (``in_process_limit``); 0: off
    in_process_restarts: int | None = None

    def __post_init__(self) -> None:
        check_positive("checkpoint.interval_steps", self.interval_steps)
        check_positive("checkpoint.keep_last", self.keep_last)
        check_positive(
            "checkpoint.memory_interval_steps", self.memory_interval_steps, allow_zero=True
        )
        check_positive("checkpoint.memory_max_GiB", self.memory_max_GiB)
        check_positive("checkpoint.in_process_restarts", self.in_process_restarts, allow_zero=True)

    def in_process_limit(self, cuda: bool) -> int:
        """In-process restarts this launch allows: the field when set; unset, the default where
        an in-process restart is safe: on gloo (a rank tells its peers by shutting its
        collective sockets; tested with real processes), not on NCCL, where a communicator
        must be aborted (not implemented). Unset, it covers exceptions only; a hang stays the
        watchdog's exit and the agent's restart (a peer stopped by SIGSTOP looks like a stall to
        the rank waiting on it, and an interrupt would only delay the agent by one bound)."""
        if self.in_process_restarts is not None:
            return self.in_process_restarts
        return 0 if cuda else DEFAULT_IN_PROCESS_RESTARTS
