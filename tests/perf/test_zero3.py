"""ZeRO-3 parameter movement: FSDP-style bucketed gathers vs DeepSpeed 0.3's per-tensor ones."""

import pytest

from aihpc.perf.step.estimate import estimate_plan
from aihpc.perf.step.flops import param_tensors_per_layer, persistent_tensors_per_layer
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec import SpecError, runspec_from_dict


def gpt3(num_gpus: int, gather: str, mbs: int = 1):
    return runspec_from_dict(
        {
            "model": {"preset": "gpt3-175b", "position_embedding": "learned"},
            "cluster": {"gpu": "a100-80gb", "num_gpus": num_gpus},
            "parallel": {
                "tp": 1,
                "pp": 1,
                "zero_stage": 3,
                "recompute": "full",
                "micro_batch_size": mbs,
                "global_batch_size": num_gpus * mbs,
            },
            "training": {"precision": "fp16", "zero3_gather": gather},
        }
    )


def dp_comm(spec) -> float:
    est = estimate_plan(spec.model, spec.cluster, spec.plan(), spec.training)
    return est.time_s["dp_comm"]


def test_gpt_layer_holds_twelve_tensors_llama_six() -> None:
    """Megatron's layout: fused QKV, proj, fc1, fc2 (+ 4 biases and 2 LayerNorms of w, b)."""
    assert param_tensors_per_layer(gpt3(8, "bucketed").model) == 12
    llama = runspec_from_dict(
        {"model": {"preset": "llama3-8b"}, "cluster": {"gpu": "h100-sxm", "num_gpus": 8}}
    )
    assert param_tensors_per_layer(llama.model) == 6


def test_per_tensor_gathers_are_exposed_and_grow_with_ranks() -> None:
    """DeepSpeed 0.3 synchronises before every gather (nothing hides) and its list-based
    collectives copy each of the n partitions: at a fixed per-GPU batch the exposed time grows
    with n, by at least the extra copy kernels, while FSDP-style prefetch hides it."""
    small, large = gpt3(384, "per_tensor"), gpt3(1536, "per_tensor")
    t_small, t_large = dp_comm(small), dp_comm(large)
    layers = small.model.num_layers
    tensors = layers * param_tensors_per_layer(small.model)
    persistent = layers * persistent_tensors_per_layer(small.model)
    gathered = tensors - persistent + 2  # the matrices and the two embeddings
    # forward, recompute and backward gathers, every tensor's reduce-scatter, and after the step
    # the persistent ones copied out of every rank's slice
    collectives = 3 * gathered + tensors + persistent
    extra_copies = collectives * (1536 - 384) * DEFAULT_PARAMS.kernel_overhead_s
    assert t_large - t_small >= extra_copies
    assert dp_comm(gpt3(1536, "bucketed")) < 0.25 * t_large


def test_python_partition_loops_cost_host_time_per_rank() -> None:
    """DeepSpeed 0.3 builds each collective's n partition views in Python on the training
    thread: one `narrow` per rank for a gather (forward, recompute, backward), `view` and
    `narrow` for a reduce-scatter, three views and a `copy_` per rank for each persistent
    tensor after the step. With the host cost of a view set to zero, exactly that much goes."""
    import dataclasses

    spec = gpt3(1536, "per_tensor")
    est = estimate_plan(spec.model, spec.cluster, spec.plan(), spec.training)
    free = dataclasses.replace(DEFAULT_PARAMS, host_op_overhead_s=0.0)
    est0 = estimate_plan(spec.model, spec.cluster, spec.plan(), spec.training, params=free)
    layers = spec.model.num_layers
    tensors = layers * param_tensors_per_layer(spec.model)
    persistent = layers * persistent_tensors_per_layer(spec.model)
    gathered = tensors - persistent + 2
    views = 3 * gathered + 2 * tensors + (4 * persistent + 1)
    expected = views * 1536 * DEFAULT_PARAMS.host_op_overhead_s
    assert est.time_s["dp_comm"] - est0.time_s["dp_comm"] == pytest.approx(expected, rel=1e-9)
    bucketed = gpt3(1536, "bucketed")
    b = estimate_plan(bucketed.model, bucketed.cluster, bucketed.plan(), bucketed.training)
    b0 = estimate_plan(
        bucketed.model, bucketed.cluster, bucketed.plan(), bucketed.training, params=free
    )
    assert b.step_time_s == b0.step_time_s  # FSDP-style gathers loop over no ranks in Python


def test_per_tensor_keeps_one_tensor_gathered_not_two_layers() -> None:
    from aihpc.perf.step.batch_memory import memory_breakdown

    per_tensor, bucketed = gpt3(384, "per_tensor"), gpt3(384, "bucketed")
    a = memory_breakdown(
        per_tensor.model, per_tensor.cluster, per_tensor.plan(), per_tensor.training
    )
    b = memory_breakdown(bucketed.model, bucketed.cluster, bucketed.plan(), bucketed.training)
    h = 12288
    # bucketed: two gathered 16-bit layers (12 h^2 each); per-tensor: two fc1 weights (4 h^2)
    assert b.weights - a.weights == pytest.approx(2 * 2 * (12 * h * h - 4 * h * h), rel=0.01)


def test_unknown_gather_kind_is_refused() -> None:
    with pytest.raises(SpecError) as err:
        gpt3(8, "flat")
    assert err.value.field == "training.zero3_gather"


def test_per_tensor_zero3_refuses_pipelining_and_search_skips_it() -> None:
    """DeepSpeed's ZeRO-3 has no pipeline engine: estimating such a plan is bad input, and the
    search leaves those combinations out with the reason counted."""
    from aihpc.perf.search.ranking import search

    spec = runspec_from_dict(
        {
            "model": {"preset": "gpt3-175b", "position_embedding": "learned"},
            "cluster": {"gpu": "a100-80gb", "num_gpus": 64},
            "parallel": {"tp": 8, "pp": 8, "zero_stage": 3, "global_batch_size": 64},
            "training": {"precision": "fp16", "zero3_gather": "per_tensor"},
        }
    )
    with pytest.raises(SpecError) as err:
        estimate_plan(spec.model, spec.cluster, spec.plan(), spec.training)
    assert err.value.field == "training.zero3_gather"
    free_pp = runspec_from_dict(
        {
            "model": {"preset": "gpt3-175b", "position_embedding": "learned"},
            "cluster": {"gpu": "a100-80gb", "num_gpus": 64},
            "parallel": {"tp": 8, "zero_stage": 3, "global_batch_size": 64},
            "training": {"precision": "fp16", "zero3_gather": "per_tensor"},
        }
    )
    result = search(free_pp, explain=3)
    assert all(e.plan.pp == 1 for e in result.plans + [r.estimate for r in result.rejected_best])
    assert result.invalid_reasons["training.zero3_gather (per-tensor ZeRO-3 has no pipelining)"] > 0


def test_small_tensors_persist_and_are_gathered_once_per_step() -> None:
    """DeepSpeed 0.3 keeps tensors under 1e5 elements (biases, norms) gathered: a GPT layer's 8
    small ones are not gathered per pass; after the optimizer step each is copied out of every
    rank's slice, so that cost grows with ranks and layers, not with micro-batches."""
    assert persistent_tensors_per_layer(gpt3(8, "per_tensor").model) == 8
    llama = runspec_from_dict(
        {"model": {"preset": "llama3-8b"}, "cluster": {"gpu": "h100-sxm", "num_gpus": 8}}
    )
    assert persistent_tensors_per_layer(llama.model) == 2
    one = gpt3(384, "per_tensor")
    two = runspec_from_dict(
        {
            "model": {"preset": "gpt3-175b", "position_embedding": "learned"},
            "cluster": {"gpu": "a100-80gb", "num_gpus": 384},
            "parallel": {
                "tp": 1,
                "pp": 1,
                "zero_stage": 3,
                "recompute": "full",
                "micro_batch_size": 1,
                "global_batch_size": 2 * 384,  # two micro-batches per step
            },
            "training": {"precision": "fp16", "zero3_gather": "per_tensor"},
        }
    )
    post_step = 2 * dp_comm(one) - dp_comm(two)  # paid once per step, not per micro-batch
    persistent = one.model.num_layers * persistent_tensors_per_layer(one.model)
    assert post_step >= persistent * 384 * DEFAULT_PARAMS.kernel_overhead_s > 0
