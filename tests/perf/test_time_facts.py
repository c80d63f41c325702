"""Run facts that change the step time: when gradients are reduced, how attention is launched."""

from dataclasses import replace

import pytest

from aihpc.perf.step import comm, compute
from aihpc.perf.step.estimate import estimate_plan
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec import runspec_from_dict


def gpt(overlap: bool, heads: int = 48):
    return runspec_from_dict(
        {
            "model": {
                "num_layers": 24,
                "hidden_size": 6144,
                "num_attention_heads": heads,
                "ffn_hidden_size": 24576,
                "vocab_size": 51200,
                "seq_length": 2048,
                "position_embedding": "learned",
            },
            "cluster": {"gpu": "a100-80gb", "num_gpus": 32},
            "parallel": {
                "tp": 1,
                "pp": 1,
                "zero_stage": 0,
                "recompute": "full",
                "micro_batch_size": 1,
                "global_batch_size": 32,
            },
            "training": {
                "precision": "fp16",
                "attention": "unfused",
                "dropout": 0.1,
                "grad_reduce_overlap": overlap,
            },
        }
    )


def test_gradients_reduced_after_the_backward_are_fully_exposed() -> None:
    """Megatron-LM's local DDP (2021) all-reduces after the whole backward: the step pays the
    whole all-reduce; overlapped (DDP buckets) it hides behind the last backward."""
    late, early = gpt(False), gpt(True)
    t_late = estimate_plan(late.model, late.cluster, late.plan(), late.training).time_s
    t_early = estimate_plan(early.model, early.cluster, early.plan(), early.training).time_s
    from aihpc.perf.step.flops import embedding_params, params_per_layer

    embeddings = 1 if late.model.tied_embeddings else 2  # input embedding and output layer
    grads = 4.0 * (24 * params_per_layer(late.model) + embeddings * embedding_params(late.model))
    full = comm.collective_time_s(late.cluster, "all_reduce", grads, 32)
    assert t_late["dp_comm"] == pytest.approx(full, rel=1e-9)
    assert t_early["dp_comm"] < 0.5 * t_late["dp_comm"]


@pytest.mark.parametrize("heads", [24, 96])
def test_unfused_attention_is_one_batched_launch_per_matmul(heads: int) -> None:
    """QK^T and PV run as one baddbmm / bmm over every (sequence, head): raising the launch
    cost moves the forward attention by 2 GEMM launches + 2 softmax/dropout kernels, whatever
    the number of heads."""
    r = gpt(True, heads)
    slow = replace(DEFAULT_PARAMS, kernel_overhead_s=1e-3)
    a = compute.layer_times(r.model, r.cluster.gpu, r.plan(), r.training, DEFAULT_PARAMS)
    b = compute.layer_times(r.model, r.cluster.gpu, r.plan(), r.training, slow)
    assert b.fwd_attn - a.fwd_attn == pytest.approx(4 * (1e-3 - DEFAULT_PARAMS.kernel_overhead_s))


def test_embedding_bucket_reduction_is_exposed_even_with_overlap() -> None:
    """Megatron-Core's distributed optimizer gives the embedding a bucket of its own; its
    gradients are ready only when the backward ends and its parameters are needed before the
    first layer, so that reduce-scatter and all-gather stay on the critical path."""
    from aihpc.perf.step.flops import embedding_params

    spec = gpt(True)
    plan = replace(spec.plan(), zero_stage=1)
    t = estimate_plan(spec.model, spec.cluster, plan, spec.training).time_s
    edge = embedding_params(spec.model)
    rs = comm.collective_time_s(spec.cluster, "reduce_scatter", 4.0 * edge, 32)
    ag = comm.collective_time_s(spec.cluster, "all_gather", 2.0 * edge, 32)
    assert t["dp_comm"] >= rs + ag > 0
    big = replace(spec.model, vocab_size=4 * spec.model.vocab_size)
    t_big = estimate_plan(big, spec.cluster, plan, spec.training).time_s
    assert t_big["dp_comm"] > t["dp_comm"] + 2 * (rs + ag)


def long_context(cp_exchange: str, kv_repeat: bool, gpus_per_node: int = 8, ctas: int = 0):
    return runspec_from_dict(
        {
            "model": {"preset": "llama3-8b", "seq_length": 131072},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 32, "gpus_per_node": gpus_per_node},
            "parallel": {
                "tp": 4,
                "cp": 8,
                "zero_stage": 1,
                "recompute": "full",
                "micro_batch_size": 1,
                "global_batch_size": 1,
            },
            "training": {"cp_exchange": cp_exchange, "kv_repeat": kv_repeat, "cp_comm_ctas": ctas},
        }
    )


def test_allgather_context_parallel_is_hidden_only_behind_the_first_block() -> None:
    """PyTorch's context_parallel all-gathers every rank's K/V at once and can hide that only
    behind the first of the cp attention blocks; the ring hides each transfer behind a block.
    Across nodes the all-gather shows, and repeating K/V to every query head (torchtitan's
    repeat_kv) multiplies the bytes by heads / kv_heads."""

    def cp_time(spec):
        return estimate_plan(spec.model, spec.cluster, spec.plan(), spec.training).time_s["cp_comm"]

    ring = cp_time(long_context("ring", False))
    gathered = cp_time(long_context("allgather", False))
    repeated = cp_time(long_context("allgather", True))
    assert ring == 0.0  # 7 transfers of GQA K/V hide behind 7 blocks
    assert gathered > ring
    assert repeated > 3 * gathered  # 32 heads instead of 8
    # Within one NVLink domain the same exchange is far cheaper than across nodes.
    in_node = cp_time(long_context("allgather", True, gpus_per_node=32))
    assert in_node < repeated / 5


def test_a_one_cta_context_parallel_ring_shows_behind_short_attention() -> None:
    """NVIDIA's recipes cap the CP communicator to one CTA: each K/V transfer then moves at one
    channel's figure (18.9 GB/s on H100) and the ring no longer hides behind the attention
    blocks. The exposed time is exactly what the ring's transfers exceed the hidden share of the
    blocks by: forward cp - 1 K/V messages, backward cp messages carrying 2 (cp - 1) blocks
    (Transformer Engine's p2p ring: K/V alone, K/V with dK/dV, dK/dV alone)."""
    free = long_context("ring", False, gpus_per_node=32)  # the CP group inside one NVLink domain
    capped = long_context("ring", False, gpus_per_node=32, ctas=1)
    est = estimate_plan(capped.model, capped.cluster, capped.plan(), capped.training)
    p, plan, m = DEFAULT_PARAMS, capped.plan(), capped.model
    lt = compute.layer_times(m, capped.cluster.gpu, plan, capped.training, p)
    kv = 2 * (m.seq_length / plan.cp) * max(1.0, m.kv_heads / plan.tp) * m.kv_channels * 2.0
    channel = capped.cluster.gpu.p2p_channel_bw_GBps * 1e9
    step = p.scale_up_latency_s + kv / channel
    fwd_x = max(0.0, (plan.cp - 1) * step - p.overlap_efficiency * lt.fwd_attn)
    bwd = plan.cp * p.scale_up_latency_s + 2 * (plan.cp - 1) * kv / channel
    bwd_x = max(0.0, bwd - p.overlap_efficiency * lt.bwd_attn)
    layers = m.num_layers
    assert est.time_s["cp_comm"] == pytest.approx(layers * (2 * fwd_x + bwd_x), rel=1e-9)
    assert est.time_s["cp_comm"] > 0.0
    t_free = estimate_plan(free.model, free.cluster, free.plan(), free.training).time_s
    assert t_free["cp_comm"] == 0.0


def llama_fp8(fp8_param_gather: bool, precision: str = "fp8"):
    return runspec_from_dict(
        {
            "model": {"preset": "llama3-8b", "seq_length": 512},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 64},
            "parallel": {
                "tp": 1,
                "pp": 1,
                "zero_stage": 1,
                "recompute": "none",
                "micro_batch_size": 1,
                "global_batch_size": 64,
            },
            "training": {"precision": precision, "fp8_param_gather": fp8_param_gather},
        }
    )


def test_fp8_parameter_gathers_move_the_layer_weights_in_one_byte() -> None:
    """With FP8 parameters (Megatron-Core fp8_param_gather, torchao's FSDP float8 all-gather)
    the ZeRO-1 parameter all-gather carries the layers' weights at 1 byte; the embeddings stay
    16-bit. On a step too short to hide the gather the saving is exactly the difference of the
    two all-gathers; nothing else moves."""
    from aihpc.perf.step.flops import embedding_params, params_per_layer

    bf16, fp8 = llama_fp8(False), llama_fp8(True)
    a = estimate_plan(bf16.model, bf16.cluster, bf16.plan(), bf16.training)
    b = estimate_plan(fp8.model, fp8.cluster, fp8.plan(), fp8.training)
    layers = bf16.model.num_layers * params_per_layer(bf16.model)
    emb = embedding_params(bf16.model)  # untied: input embedding + output layer, one of them

    def gather(size: float) -> float:
        return comm.collective_time_s(bf16.cluster, "all_gather", size, 64)

    # the edge bucket (the input embedding) is gathered on its own in both; the rest is the
    # layers plus the untied output layer
    saved = gather(2.0 * layers + 2.0 * emb) - gather(1.0 * layers + 2.0 * emb)
    assert saved > 0
    assert a.time_s["dp_comm"] - b.time_s["dp_comm"] == pytest.approx(saved, rel=1e-9)
    assert a.time_s["compute"] == b.time_s["compute"]
    assert a.memory.total == b.memory.total  # weight memory is not modelled by it


def test_fp8_parameter_gathers_need_fp8_precision() -> None:
    from aihpc.runspec import SpecError

    with pytest.raises(SpecError) as err:
        llama_fp8(True, precision="bf16")
    assert err.value.field == "training.fp8_param_gather"
    assert "fp8" in str(err.value)


@pytest.mark.parametrize("sp", [False, True])
def test_hidden_dropout_moves_its_masks(sp: bool) -> None:
    """Fused bias-dropout-add writes one 1-byte mask per element after attention and after the
    MLP (2h bytes per token, split over TP with sequence parallel); without dropout none."""
    spec = gpt(True)
    plan = replace(spec.plan(), tp=2, dp=16, sequence_parallel=sp)
    model, h = spec.model, spec.model.hidden_size
    f = model.ffn_hidden_size

    def per_token(dropout: float) -> float:
        training = replace(spec.training, dropout=dropout)
        return compute.elementwise_bytes_per_token(model, plan, training, f, f)

    assert per_token(0.1) - per_token(0.0) == pytest.approx(2 * h / (2 if sp else 1), rel=1e-12)


def test_every_hidden_collective_slows_compute() -> None:
    """The compute slow-down beside a collective applies to whatever the collective is: with
    no data parallelism, the TP communication a framework hides behind GEMMs still costs
    overlap_compute_penalty per second hidden (what tp_comm_overlap = "none" exposes on top of
    the default "backward" is what the default hides)."""
    spec = gpt(True)
    cluster = replace(spec.cluster, num_gpus=8)
    plan = replace(spec.plan(), tp=8, dp=1, sequence_parallel=True, global_batch_size=4)

    def run(p: float, mode: str = "backward"):
        params = replace(DEFAULT_PARAMS, overlap_compute_penalty=p)
        training = replace(spec.training, tp_comm_overlap=mode)
        return estimate_plan(spec.model, cluster, plan, training, params).time_s

    base, slowed = run(0.0), run(DEFAULT_PARAMS.overlap_compute_penalty)
    hidden_tp = run(0.0, "none")["tp_comm"] - base["tp_comm"]
    assert hidden_tp > 0 and base["dp_comm"] == 0
    extra = slowed["compute"] - base["compute"]
    assert extra == pytest.approx(DEFAULT_PARAMS.overlap_compute_penalty * hidden_tp, rel=1e-9)


@pytest.mark.parametrize("attention", ["flash", "flash2"])
def test_dropout_inside_a_fused_attention_kernel_costs_its_measured_share(attention: str) -> None:
    """A fused kernel draws the dropout mask from its RNG state: no extra bytes, but the
    measured share of extra kernel time (fused_attention_dropout_cost), forward and backward."""
    spec = gpt(True)
    plan = spec.plan()

    def times(dropout: float):
        training = replace(spec.training, attention=attention, dropout=dropout)
        return compute.layer_times(spec.model, spec.cluster.gpu, plan, training, DEFAULT_PARAMS)

    plain, drop = times(0.0), times(0.1)
    k = 1 + DEFAULT_PARAMS.fused_attention_dropout_cost
    assert drop.fwd_attn == pytest.approx(k * plain.fwd_attn, rel=1e-12)
    assert drop.bwd_attn == pytest.approx(k * plain.bwd_attn, rel=1e-12)
    assert drop.fwd_gemm == plain.fwd_gemm


def test_a_capped_pipeline_communicator_sends_at_its_channels() -> None:
    """`pp_comm_ctas = 2` (NVIDIA's recipes): every stage-to-stage send across nodes moves at two
    of NCCL's 14 GB/s network channels instead of the NIC's share; nothing else moves."""

    def spec(ctas: int):
        return runspec_from_dict(
            {
                "model": {"preset": "llama3-70b"},
                "cluster": {"gpu": "h100-sxm", "num_gpus": 64},
                "parallel": {
                    "tp": 8,
                    "pp": 4,
                    "sequence_parallel": True,
                    "micro_batch_size": 1,
                    "global_batch_size": 16,
                },
                "training": {"pp_comm_ctas": ctas},
            }
        )

    free, capped = spec(0), spec(2)
    t0 = estimate_plan(free.model, free.cluster, free.plan(), free.training).time_s
    t1 = estimate_plan(capped.model, capped.cluster, capped.plan(), capped.training).time_s
    plan, m = capped.plan(), capped.model
    msg = plan.micro_batch_size * m.seq_length * m.hidden_size * 2.0 / plan.tp
    hop = DEFAULT_PARAMS.scale_out_latency_s + msg / (2 * 14e9)
    transfers = 2.0 * (plan.num_microbatches + (plan.pp - 1) * plan.vpp)
    assert t1["pp_comm"] == pytest.approx(transfers * hop, rel=1e-12)
    assert t1["pp_comm"] > t0["pp_comm"]
    assert {k: v for k, v in t1.items() if k != "pp_comm"} == {
        k: v for k, v in t0.items() if k != "pp_comm"
    }
