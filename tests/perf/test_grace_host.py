"""A Grace host (GB200, GB300) issues each eager op slower than the x86 host the per-op costs were
measured on (runspec/data/host_cpus.toml, TransformerEngine #2053): the training step's host
issue, an eager MoE layer's (perf/step/moe_host.py) and an eager or compiled layer's
(perf/step/host_issue.py), is the x86 one times the data's ratio on gb200 and unchanged on h100."""

from __future__ import annotations

import tomllib
from dataclasses import replace
from importlib import resources

import pytest

from aihpc.perf.step import host_issue as hi
from aihpc.perf.step.compute import layer_times
from aihpc.perf.step.moe_host import moe_host_excess_s
from aihpc.perf.step.params import DEFAULT_PARAMS as P
from aihpc.runspec.host_cpu import host_cpu_ratio
from aihpc.runspec.runspec import runspec_from_dict


def _data_ratio() -> dict[str, float]:
    """gpu id -> its row's per-call time over the reference row's, read from the file itself."""
    text = resources.files("aihpc.runspec").joinpath("data/host_cpus.toml").read_text()
    rows = tomllib.loads(text)["host_cpu"]
    assert all(len(r["source"]) > 40 and r["torch_op_cpu_us"] > 0 for r in rows)
    (ref,) = [r["torch_op_cpu_us"] for r in rows if r.get("reference")]
    return {g: r["torch_op_cpu_us"] / ref for r in rows for g in r["gpus"]}


def test_the_ratio_is_the_datas_and_one_on_an_x86_host() -> None:
    data = _data_ratio()
    assert data["gb200"] > 2 and data["gb300"] == data["gb200"]
    for gpu in ("gb200", "gb300", "h100-sxm"):
        assert host_cpu_ratio(gpu) == pytest.approx(data[gpu])
    assert host_cpu_ratio("h100-sxm") == 1.0
    assert host_cpu_ratio("b200") == 1.0 and host_cpu_ratio("custom") == 1.0  # in no row


def test_an_eager_moe_layers_host_terms_scale_by_the_ratio() -> None:
    """Host-bound (a GPU with nothing to do): every host term, the Python ops and the C++
    launches, is the x86 one times the ratio; GPU-bound, only the issue after the sync."""
    r = _data_ratio()["gb200"]
    scaled = replace(
        P, host_eager_op_s=P.host_eager_op_s * r, kernel_overhead_s=P.kernel_overhead_s * r
    )
    for gpu_f, gpu_b, moe in ((0.0, 0.0, None), (1e-3, 2e-3, 0.6e-3), (1.0, 2.0, 0.5)):
        got = moe_host_excess_s(gpu_f, gpu_b, "alltoall", "bf16", 16, P, moe, host_ratio=r)
        assert got == pytest.approx(
            moe_host_excess_s(gpu_f, gpu_b, "alltoall", "bf16", 16, scaled, moe)
        )
    x86 = moe_host_excess_s(0.0, 0.0, "alltoall", "bf16", 16, P)
    grace = moe_host_excess_s(0.0, 0.0, "alltoall", "bf16", 16, P, host_ratio=r)
    assert grace == pytest.approx((x86[0] * r, x86[1] * r))


def _layer(gpu: str, **training):
    """Qwen3-30B-A3B on 16 GPUs, EP 16, Megatron's eager alltoall path: one MoE layer."""
    spec = runspec_from_dict(
        {
            "model": {"preset": "qwen3-30b-a3b"},
            "cluster": {"gpu": gpu, "num_gpus": 16},
            "parallel": {"global_batch_size": 1024, "tp": 1, "pp": 1, "ep": 16},
            "training": {"precision": "bf16", "moe_dispatcher": "alltoall", **training},
        }
    )
    plan = replace(spec.plan(), zero_stage=1, recompute="none", micro_batch_size=1)
    gpu_spec = spec.cluster.gpu
    return layer_times(spec.model, gpu_spec, plan, spec.training, P, moe=True), gpu_spec


LOCAL = 128 / 16  # Qwen3-30B-A3B's experts over EP 16


@pytest.mark.parametrize("gpu", ["gb200", "h100-sxm"])
def test_the_layer_prices_its_hosts_ratio(gpu: str) -> None:
    """layer_times' eager MoE host wait is moe_host's at the GPU's host ratio: the data's on
    gb200, 1 (the x86 price as it stood) on h100."""
    lt, _ = _layer(gpu, cuda_graphs="none")
    ratio = _data_ratio()[gpu]
    graphed, _ = _layer(gpu, cuda_graphs="full")
    want = moe_host_excess_s(
        graphed.fwd, graphed.bwd, "alltoall", "bf16", LOCAL, P, graphed.mlp_fwd, ratio
    )
    assert (lt.fwd_host, lt.bwd_host) == pytest.approx(want)
    if gpu == "h100-sxm":
        plain = moe_host_excess_s(
            graphed.fwd, graphed.bwd, "alltoall", "bf16", LOCAL, P, graphed.mlp_fwd
        )
        assert (lt.fwd_host, lt.bwd_host) == pytest.approx(plain)


def test_a_dense_layers_issue_scales_by_the_ratio_on_a_gpu() -> None:
    """host_issue.layer_issue_s: an eager and a compiled layer's issue on gb200 is the x86 count
    times the ratio; on h100 issue_host_s unchanged."""
    spec = _layer("h100-sxm")[1]
    grace = replace(spec, id="gb200")
    r = _data_ratio()["gb200"]
    for training in ({"fused_kernels": False}, {"compile": True}):
        t = runspec_from_dict(
            {
                "model": {"preset": "tiny-llama-small"},
                "cluster": {"gpu": "h100-sxm", "num_gpus": 1},
                "parallel": {"micro_batch_size": 1, "global_batch_size": 4},
                "training": training,
            }
        ).training
        x86 = hi.issue_host_s(t, P)
        assert x86[0] > 0 and hi.layer_issue_s(t, P, spec) == pytest.approx(x86)
        assert hi.layer_issue_s(t, P, grace) == pytest.approx((x86[0] * r, x86[1] * r))
