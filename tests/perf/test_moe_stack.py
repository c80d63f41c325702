"""The MoE software stack as a run fact (issue 37): each stack's dispatch priced from its kernels'
published figures on the fabric it reaches, the figures' table, and the stack's rules."""

from __future__ import annotations

import csv
import io
from dataclasses import replace
from importlib import resources

import pytest

from aihpc.perf.step import comm
from aihpc.perf.step.batch_shapes import moe_comm_fwd_s
from aihpc.perf.step.estimate import estimate_plan
from aihpc.perf.step.moe_stack import kernel_GBps, ranks_touched, stacks
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec.runspec import RunSpec, runspec_from_dict
from aihpc.runspec.training import MOE_STACK_DISPATCHER, MOE_STACKS


def spec(gpu: str, gpus: int, ep: int, stack: str, domain: int = 0, **training: object) -> RunSpec:
    cluster: dict[str, object] = {"gpu": gpu, "num_gpus": gpus}
    if domain:
        cluster["scale_up_domain"] = domain
    return runspec_from_dict(
        {
            "model": {"preset": "deepseek-v3"},
            "cluster": cluster,
            "parallel": {
                "tp": 1,
                "pp": 8,
                "cp": 1,
                "ep": ep,
                "zero_stage": 1,
                "recompute": "none",
                "micro_batch_size": 1,
                "global_batch_size": 4096,
            },
            "training": {"precision": "fp8", "moe_stack": stack, **training},
        }
    )


def ep_fwd(s: RunSpec) -> float:
    def collective(what: str, size: float, n: int, stride: int) -> float:
        return comm.collective_time_s(s.cluster, what, size, n, stride, DEFAULT_PARAMS)

    plan = s.plan()
    return moe_comm_fwd_s(s.model, s.cluster, plan, s.training, DEFAULT_PARAMS, collective)


def test_every_stack_is_in_the_data_and_names_its_source() -> None:
    data = stacks()
    assert set(data) == set(MOE_STACKS) - {"unknown"}
    for name, st in data.items():
        assert st.source, name
        assert MOE_STACK_DISPATCHER[name] == (
            "alltoall" if st.dispatcher == "allgather" else st.dispatcher
        )
        assert st.kernel in ("nccl", "deepep", "hybridep")


def test_every_kernel_figure_names_its_source_and_is_below_its_link() -> None:
    text = resources.files("aihpc.perf.step").joinpath("data/moe_a2a_kernels.csv").read_text()
    rows = list(csv.DictReader(io.StringIO(text)))
    assert rows
    for r in rows:
        assert r["source"].startswith(("deepseek-ai/DeepEP", "NVIDIA/Megatron-LM")), r
        link = float(r["link_GBps"])
        for col in ("dispatch_fp8_GBps", "dispatch_bf16_GBps", "combine_GBps"):
            if r[col]:  # an RDMA algorithm bandwidth counts the own node's rows: may pass 1x
                assert 0 < float(r[col]) < (1.2 if r["tier"] == "rdma" else 1.0) * link, r


def test_kernel_figures_interpolate_and_clamp() -> None:
    at8 = kernel_GBps("hybridep", "gb200", "nvlink", 8, 16, "dispatch_bf16", 900.0)
    at16 = kernel_GBps("hybridep", "gb200", "nvlink", 16, 16, "dispatch_bf16", 900.0)
    at12 = kernel_GBps("hybridep", "gb200", "nvlink", 12, 16, "dispatch_bf16", 900.0)
    assert at8 == pytest.approx(550.10) and at16 == pytest.approx(472.84)
    assert at16 < at12 < at8
    assert kernel_GBps("hybridep", "gb200", "nvlink", 72, 16, "combine", 900.0) == pytest.approx(
        418.27
    )
    # Between the measured SM counts (DeepEP on B200: 16 and 24 SMs), and scaled by the link.
    b16 = kernel_GBps("deepep", "b200", "nvlink", 8, 16, "combine", 900.0)
    b24 = kernel_GBps("deepep", "b200", "nvlink", 8, 24, "combine", 900.0)
    b20 = kernel_GBps("deepep", "b200", "nvlink", 8, 20, "combine", 900.0)
    assert b16 < b20 < b24
    assert kernel_GBps("deepep", "b200", "nvlink", 8, 24, "combine", 450.0) == pytest.approx(
        b24 / 2
    )
    assert kernel_GBps("deepep", "a100-80gb", "nvlink", 8, 24, "combine", 300.0) is None


def test_ranks_touched_follow_routing_and_node_limits() -> None:
    d, r = ranks_touched(8, 8, 1, 0)  # one NVLink group of 8: 8 (1 - (7/8)^8) ranks
    assert d == 1 and r == pytest.approx(8 * (1 - (7 / 8) ** 8))
    d, _ = ranks_touched(64, 8, 8, 0)
    d4, r4 = ranks_touched(64, 8, 8, 4)  # DeepSeek-V3: at most 4 nodes per token
    assert d4 == 4 < d and r4 <= 4 * 8


def test_deepep_leaves_an_nvl72_rack_over_the_nics_hybridep_stays_on_nvlink() -> None:
    """EP 32 on one GB200 NVL72 rack: HybridEP and NCCL reach all 32 ranks over NVLink, and so
    did Megatron-Core's DeepEP build in NVIDIA's GB200 runs (at 400 / 190 GB/s, slower than
    HybridEP); torchtitan's DeepEP (NVLink8) reaches 8, so most bytes cross the NICs."""
    cluster = spec("gb200", 64, 32, "unknown").cluster
    assert comm.group_tiers(cluster, 32, 1) == (32, 1)
    assert comm.group_tiers(cluster, 32, 1, 8) == (8, 4)
    hybrid = ep_fwd(spec("gb200", 64, 32, "megatron-hybridep"))
    mcore_deepep = ep_fwd(spec("gb200", 64, 32, "megatron-deepep"))
    titan_deepep = ep_fwd(spec("gb200", 64, 32, "torch-deepep"))
    assert hybrid < mcore_deepep < titan_deepep
    assert titan_deepep > 1.5 * mcore_deepep


def test_on_an_hgx_node_both_deepep_builds_price_alike() -> None:
    """On H100 the NVLink domain is the node of 8: the reach of 8 changes nothing."""
    mcore = ep_fwd(spec("h100-sxm", 256, 32, "megatron-deepep"))
    titan = ep_fwd(spec("h100-sxm", 256, 32, "torch-deepep"))
    assert mcore == pytest.approx(titan)


def test_an_nvl36_domain_puts_ep_64_across_two_racks() -> None:
    nvl72 = ep_fwd(spec("gb200", 256, 64, "megatron-hybridep", domain=72))
    nvl36 = ep_fwd(spec("gb200", 256, 64, "megatron-hybridep", domain=36))
    assert nvl36 > nvl72


def test_stack_dispatch_grows_with_tokens_and_shrinks_with_the_link() -> None:
    base = spec("h100-sxm", 256, 32, "megatron-deepep")
    more = replace(base, parallel=replace(base.parallel, micro_batch_size=2))
    assert ep_fwd(more) > ep_fwd(base)
    fast = replace(base, cluster=replace(base.cluster, scale_out_bw_GBps=100.0))
    assert ep_fwd(fast) < ep_fwd(base)


def test_fp8_dispatch_is_cheaper_than_bf16_on_the_same_kernel() -> None:
    fp8 = ep_fwd(spec("h100-sxm", 256, 32, "megatron-hybridep", moe_dispatch_dtype="fp8"))
    bf16 = ep_fwd(spec("h100-sxm", 256, 32, "megatron-hybridep", moe_dispatch_dtype="bf16"))
    assert fp8 < bf16


def test_allgather_moves_every_token_of_the_group() -> None:
    ag = ep_fwd(spec("h100-sxm", 256, 32, "megatron-allgather"))
    a2a = ep_fwd(spec("h100-sxm", 256, 32, "megatron-alltoall"))
    assert ag > a2a  # 32 ranks' tokens to every rank vs top-8 copies


def test_unknown_stack_prices_as_before_and_no_stack_moves_a_dense_model() -> None:
    s = spec("h100-sxm", 256, 32, "unknown", moe_dispatcher="hierarchical")
    assert ep_fwd(s) > 0
    dense = runspec_from_dict(
        {
            "model": {"preset": "llama3-8b"},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 8},
            "parallel": {
                "tp": 8,
                "pp": 1,
                "cp": 1,
                "zero_stage": 1,
                "recompute": "none",
                "micro_batch_size": 1,
                "global_batch_size": 64,
            },
            "training": {"precision": "bf16"},
        }
    )
    plain = estimate_plan(dense.model, dense.cluster, dense.plan(), dense.training)
    for st in MOE_STACKS:
        t = replace(dense.training, moe_stack=st)
        other = estimate_plan(dense.model, dense.cluster, dense.plan(), t)
        assert other.step_time_s == plain.step_time_s, st


def test_deepspeed_pads_to_capacity() -> None:
    s = spec("h100-sxm", 256, 32, "deepspeed-moe")
    padded = replace(s, model=replace(s.model, moe_capacity_factor=2.0))
    assert ep_fwd(padded) > ep_fwd(s)


def test_deepspeed_einsum_dispatch_costs_compute() -> None:
    s = spec("h100-sxm", 256, 32, "deepspeed-moe")
    ds = estimate_plan(s.model, s.cluster, s.plan(), s.training)
    nccl = estimate_plan(
        s.model, s.cluster, s.plan(), replace(s.training, moe_stack="megatron-alltoall")
    )
    assert ds.time_s["compute"] > nccl.time_s["compute"]
