"""The model's few constants: efficiencies and overheads, each physically meaningful and shared by
every estimate (no per-run or per-source factors). A calibration file (``aihpc calibrate``)
overrides the hardware-facing ones with measured values.

Each value carries where it comes from; docs/performance-model.md lists them in one table.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_PARAMS", "ModelParams"]


@dataclass(frozen=True)
class ModelParams:
    # --- compute -------------------------------------------------------------------------------
    # Fraction of the dense tensor-core peak a large, well-shaped GEMM reaches (cuBLAS, power and
    # clock limits included). A100: ~280 of 312 TF/s; H100 SXM: ~700-760 of 989 BF16 TF/s and
    # ~1,300-1,400 of 1,979 FP8 TF/s (public cuBLAS/ThunderKittens/FA3-paper measurements).
    # Per part it is the catalog's gemm_efficiency when given, else this.
    gemm_efficiency: float = 0.80
    # GEMM size at which efficiency is half of its large-size value, in GFLOP (tile/wave
    # quantisation and launch ramp; Calculon's size tables fall off in the same range).
    gemm_half_efficiency_gflop: float = 0.5
    # Fused attention fraction of the 16-bit peak for a part whose catalog entry gives none
    # (the catalog carries FlashAttention-2/3 and cuDNN figures per part, with sources).
    attention_efficiency: float = 0.50
    # Extra time a fused attention kernel takes with dropout (the mask drawn from the RNG state
    # inside the kernel), as a fraction of its time without: cuDNN's fused attention through
    # Transformer Engine on an H200, sbhd layout, 4 x 4,096 tokens, 16 heads of 128, forward +
    # backward 0.594 -> 0.614 ms at p = 0.1 (NVIDIA/TransformerEngine issue 3312, 2026);
    # FlashAttention-2 on GB200 0.695 -> 0.728 ms (+4.7%, the same thread, PR 3313).
    fused_attention_dropout_cost: float = 0.034
    # Achievable fraction of HBM bandwidth for streaming element-wise kernels (norms, activations,
    # residual adds, softmax, optimizer): ~80-90% on A100/H100 (STREAM-like, vendor guides).
    hbm_efficiency: float = 0.80
    # Fixed cost of launching one GPU kernel that cannot be hidden (CPU launch and tail), seconds.
    kernel_overhead_s: float = 4e-6
    # Host (CPU) cost of one eager tensor op called from Python that launches no kernel (a view
    # such as `narrow`): Python binding plus dispatcher, seconds. PyTorch's operator
    # micro-benchmark timed `split` at 3.3-3.4 us per call on CPU and CUDA tensors alike before
    # pytorch/pytorch #32194 (January 2020, so in every 2021 release) and 2.26 us after it (the
    # figure shown for CPU tensors; a view's cost does not depend on the device); the later one.
    # It matters where a framework loops over ranks in Python (DeepSpeed 0.3's ZeRO-3
    # partition lists); fused or compiled paths do not pay it.
    host_op_overhead_s: float = 2.3e-6
    # Host (CPU) time to issue one eager PyTorch op on a CUDA tensor from Python (binding,
    # dispatcher, allocator and the kernel launch), seconds: 8 us per op for a 512 x 512 add
    # issued back-to-back on an A100 and synchronised once at the end, so the host's cost alone
    # (flagos-ai/Torch-FL pull request 27, 2026, "cuda_sub" of native PyTorch CUDA dispatch);
    # without the launch, a scalar multiply costs ~2 us on CPU tensors (pytorch/pytorch issue
    # 41383, 2020). Prices eager MoE layers (perf/step/moe_host.py); fitted to no run.
    host_eager_op_s: float = 8e-6
    # Host (CPU) time of one MoE layer of a decode step that a Python-driven serving engine (vLLM,
    # SGLang) runs without CUDA graphs, seconds: its router, top-k, expert alignment and grouped
    # Triton GEMMs launched from Python, beside the attention half's kernels. Published eager
    # decode steps at one sequence, less the same model's graphed step, over its MoE layers:
    # vLLM 0.8.5 with enforce_eager, Qwen3-30B-A3B (48 MoE layers) on 4 A10, "20 token per
    # seconds" against SGLang 0.4.6's CUDA-graphed "60 token per seconds" on the same GPUs
    # (vllm-project/vllm issue 17469, 2025): (50 - 16.7) ms / 48 = 0.69 ms; SGLang 0.3 without
    # graphs on DeepSeek-Coder-V2-Lite (26 MoE layers of 27), 31 against 8 ms a token on an A100
    # (sgl-project/sglang issue 1369): 0.85 ms, and about 4x its graphed 6.22 ms (pull request
    # 1401): ~0.7 ms. The lowest, and the one of vLLM's eager MoE path: the difference is a lower
    # bound of the host's time (the graphed step's GPU work runs under it). The counted kernels at
    # host_eager_op_s (16 x 8 us) give a fifth of it. Fitted to no run.
    host_eager_moe_layer_s: float = 0.69e-3
    # Host time of one eager PyTorch op on CPU tensors where the CPU is the device (no kernel
    # launch: binding, dispatcher, allocator), seconds: ~2 us for a scalar multiply (pytorch/
    # pytorch issue 41383, 2020). Prices the eager ops of a CPU host's inference step
    # (perf/infer/kernels.py); a benchmark that measures its host passes its own.
    host_cpu_op_s: float = 2e-6
    # Host (CPU) time DTensor's eager dispatch adds to one op of a tensor-parallel layer beyond
    # the plain op (unwrap, cached sharding propagation, redistribution checks, wrap), seconds:
    # aihpc calibrate --local timed the trainer's tensor-parallel decoder on a one-rank mesh
    # against the same decoder on plain tensors on the project's 2-core Xeon host (torch 2.13):
    # 45-55 us per counted op on a quiet host, up to about 100 us with its neighbours busy. Our
    # own measurement, on a CPU; a calibration
    # (`dtensor_op_us`) replaces it. Prices training.dtensor_dispatch = "eager"
    # (perf/step/dtensor_host.py); fitted to no run.
    dtensor_op_s: float = 50e-6
    # --- communication -------------------------------------------------------------------------
    # Bus bandwidth reached by large NCCL collectives as a fraction of link bandwidth:
    # NVLink4 all-reduce busbw ~360-480 of 450 GB/s (nccl-tests on DGX H100; 741/900 bidir in the
    # ASTRA-sim HGX-H100 validation = 0.82); IB NDR ~45 of 50 GB/s per rail (0.9, Calculon's IB).
    scale_up_efficiency: float = 0.80
    scale_out_efficiency: float = 0.85
    # Per-step latency of a ring collective step (NVLink / network), seconds (nccl-tests small
    # message times: ~5-10 us intra-node, ~15-25 us inter-node for 8-16 ranks).
    scale_up_latency_s: float = 5e-6
    scale_out_latency_s: float = 10e-6
    # What one NCCL channel moves point-to-point to a peer across the network, GB/s: NCCL sizes
    # network p2p at one channel per 14 GB/s (NCCL_P2P_PER_CHANNEL_NET_BW, default 14,
    # src/graph/paths.cc). Over NVLink the figure is the part's p2p_channel_bw_GBps.
    net_p2p_channel_bw_GBps: float = 14.0
    # Fraction of a collective hidden behind independent compute when the framework overlaps it
    # (DP gradient reduce-scatter in the backward, ZeRO-3 gathers prefetched, ring-attention
    # exchange). Overlap is never perfect: the collective steals SMs and HBM bandwidth.
    overlap_efficiency: float = 0.85
    # Slow-down of compute while a collective runs beside it (SM and memory contention), as a
    # fraction of the time the collective hides: "overlapping computation and communication can
    # result in an average computational slowdown of 18.9%, with a maximum of 40.0%" against the
    # same compute alone (GPT and Llama training on 4 A100s, H100s, MI250s and MI210s: arXiv
    # 2507.03114, 2025, abstract). It was 0.05, a guess with no source, until a later session.
    overlap_compute_penalty: float = 0.189
    # --- memory --------------------------------------------------------------------------------
    # Memory outside the model's tensors: CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers
    # (~1-3 GiB seen on H100 jobs), GiB per GPU.
    runtime_overhead_gib: float = 2.0
    # Caching-allocator fragmentation, as a fraction of the live tensors' bytes (PyTorch reserved
    # vs allocated on LLM training, typically 5-15%).
    allocator_fragmentation: float = 0.08


DEFAULT_PARAMS = ModelParams()
