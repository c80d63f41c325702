"""An eager MoE layer runs no faster than its host issues it (``training.cuda_graphs = "none"``,
perf/step/moe_host.py): the segment math, the op count's structure, and where the term applies."""

from dataclasses import replace

import pytest

from aihpc.perf.step.compute import layer_times
from aihpc.perf.step.moe_host import host_bound_s, moe_host_excess_s, moe_host_ops, moe_host_syncs
from aihpc.perf.step.moe_issue import SPLIT_DISPATCH_OPS, sync_ordered_s
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec.errors import SpecError
from aihpc.runspec.runspec import runspec_from_dict
from aihpc.runspec.training import TrainingSpec


def test_a_segment_takes_the_slower_of_gpu_and_host() -> None:
    # GPU-bound: the host issues everything while the GPU runs, and the GPU waits one issue
    # latency after each sync for the first op.
    assert host_bound_s(1e-3, 0.4e-3, syncs=1, issue_s=8e-6) == pytest.approx(1e-3 + 8e-6)
    assert host_bound_s(1e-3, 0.4e-3, syncs=2, issue_s=8e-6) == pytest.approx(1e-3 + 16e-6)
    # Host-bound: the GPU cannot finish before the host has issued the last op.
    assert host_bound_s(1e-3, 3e-3, syncs=1, issue_s=8e-6) == pytest.approx(3e-3)
    # No sync (the backward): the host runs ahead and only the slower side counts.
    assert host_bound_s(1e-3, 0.4e-3, syncs=0, issue_s=8e-6) == pytest.approx(1e-3)


def test_op_count_structure() -> None:
    ops_a2a, launches = moe_host_ops("alltoall", "bf16", 8)
    ops_flex, _ = moe_host_ops("hierarchical", "bf16", 8)
    assert ops_a2a > ops_flex  # the flex dispatcher fuses permute, all-to-all and sort
    assert launches == 2 * 8  # fc1 and fc2 GEMM per local expert, launched from C++
    ops_fp8, launches_fp8 = moe_host_ops("alltoall", "fp8", 8)
    assert ops_fp8 > ops_a2a and launches_fp8 > launches  # per-expert quantization
    # BF16: the per-expert work is C++ launches only; FP8 adds a Python weight cast per expert.
    assert moe_host_ops("alltoall", "bf16", 16)[0] == ops_a2a
    assert moe_host_ops("alltoall", "fp8", 16)[0] > ops_fp8
    assert moe_host_syncs("alltoall") == 1 and moe_host_syncs("hierarchical") == 2


def test_excess_is_zero_when_the_gpu_is_slower_but_for_the_issue_latency() -> None:
    p = DEFAULT_PARAMS
    fwd, bwd = moe_host_excess_s(1.0, 2.0, "alltoall", "fp8", 16, p)
    assert fwd == pytest.approx(p.host_eager_op_s) and bwd == 0.0
    # A GPU with nothing to do is bound by the host's issue time alone.
    ops, launches = moe_host_ops("alltoall", "fp8", 16)
    fwd, bwd = moe_host_excess_s(0.0, 0.0, "alltoall", "fp8", 16, p)
    assert fwd == pytest.approx(ops * p.host_eager_op_s + launches * p.kernel_overhead_s)
    assert bwd == pytest.approx(ops * p.host_eager_op_s + 2 * launches * p.kernel_overhead_s)


def _moe_layer(cuda_graphs: str, moe: bool = True, mbs: int = 1):
    """Qwen3-30B-A3B on 16 H100s with EP 16 (H09's plan, alltoall dispatcher), one layer."""
    spec = runspec_from_dict(
        {
            "model": {"preset": "qwen3-30b-a3b"},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 16},
            "parallel": {"global_batch_size": 1024, "tp": 1, "pp": 1, "ep": 16},
            "training": {
                "precision": "fp8",
                "moe_expert_gemm": "per_expert",
                "cuda_graphs": cuda_graphs,
            },
        }
    )
    plan = replace(spec.plan(), zero_stage=1, recompute="none", micro_batch_size=mbs)
    return layer_times(spec.model, spec.cluster.gpu, plan, spec.training, DEFAULT_PARAMS, moe=moe)


def test_only_eager_moe_layers_pay_the_host() -> None:
    eager, graphed, unknown = _moe_layer("none"), _moe_layer("full"), _moe_layer("unknown")
    assert graphed == unknown == replace(eager, fwd_host=0.0, bwd_host=0.0)
    assert eager.fwd_host > 0 and eager.fwd > graphed.fwd
    assert eager.bwd_host >= 0
    assert _moe_layer("partial").fwd_host == 0.0
    # A dense layer has no token counts to wait for: eager or not, the same time.
    assert _moe_layer("none", moe=False) == _moe_layer("full", moe=False)


def test_host_time_does_not_grow_with_the_micro_batch() -> None:
    one, four = _moe_layer("none", mbs=1), _moe_layer("none", mbs=4)
    host = DEFAULT_PARAMS.host_eager_op_s
    assert four.fwd_host <= one.fwd_host + host  # a bigger micro-batch hides the host better


def test_cuda_graphs_is_checked() -> None:
    with pytest.raises(SpecError, match=r"training\.cuda_graphs"):
        TrainingSpec(cuda_graphs="yes")


def test_the_moe_blocks_host_time_does_not_hide_behind_the_attention_after_it() -> None:
    # After the sync the stream starts empty: the MoE block (host-bound) then the attention
    # side (GPU-bound). max(GPU, host) over the layer would give 3 ms; in order it is 2 + 2.
    assert sync_ordered_s(2e-3, 0.5e-3, 0.2e-3, 2e-3, 1, 8e-6) == pytest.approx(4e-3)
    assert host_bound_s(2.5e-3, 2.2e-3, 1, 8e-6) < 4e-3
    # Both blocks GPU-bound: the GPU's time and one issue latency per sync, as before.
    assert sync_ordered_s(2e-3, 1e-3, 0.2e-3, 0.3e-3, 2, 8e-6) == pytest.approx(3e-3 + 16e-6)
    # Both host-bound: the host's time.
    assert sync_ordered_s(0.1e-3, 0.1e-3, 1e-3, 2e-3, 1, 8e-6) == pytest.approx(3e-3)


def test_the_dispatch_ops_split_at_the_sync_adds_up_to_the_count() -> None:
    for dispatcher, (before, after) in SPLIT_DISPATCH_OPS.items():
        whole, _ = moe_host_ops(dispatcher, "bf16", 1)
        assert before + after + 30 + 17 + 17 == whole and before > 0 and after > 0


def test_the_ordered_forward_is_never_faster_than_the_whole_layer_bound() -> None:
    p = DEFAULT_PARAMS
    for gpu_moe in (0.0, 0.2e-3, 1e-3):
        for disp in ("alltoall", "hierarchical"):
            plain = moe_host_excess_s(1.5e-3, 3e-3, disp, "fp8", 16, p)
            ordered = moe_host_excess_s(1.5e-3, 3e-3, disp, "fp8", 16, p, gpu_moe)
            assert ordered[0] >= plain[0] - 1e-12 and ordered[1] == plain[1]
