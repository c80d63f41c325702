"""Communication of a serving step: the tensor-parallel all-reduces (one-shot custom kernels for
small decode messages, NCCL for large prefill ones), MoE dispatch and combine (DeepEP's
low-latency kernels for decode, priced from their published latencies; the hierarchical
normal kernels for prefill at their published bandwidths), pipeline hops, and the KV transfer of
a disaggregated deployment.
"""

from __future__ import annotations

import itertools
import math
import tomllib
from functools import cache
from importlib import resources
from typing import Any

from aihpc.perf.step.comm import collective_time_s, p2p_time_s
from aihpc.perf.step.params import ModelParams
from aihpc.runspec.cluster import ClusterSpec, GPUSpec
from aihpc.runspec.model import ModelSpec

__all__ = [
    "deepep_ll_s",
    "kv_transfer_s",
    "moe_normal_s",
    "pp_hop_s",
    "serving_cluster",
    "tp_all_reduce_s",
]


def serving_cluster(gpu: GPUSpec, gpus: int) -> ClusterSpec:
    """The cluster a serving instance of ``gpus`` GPUs of this part runs on: whole nodes of the
    part's size, its scale-up domain and network figures."""
    per_node = gpu.gpus_per_node
    num = gpus if gpus <= per_node else math.ceil(gpus / per_node) * per_node
    domain = gpu.scale_up_domain
    if domain % per_node and per_node % domain:
        domain = per_node
    return ClusterSpec(
        gpu=gpu,
        num_gpus=num,
        gpus_per_node=per_node,
        scale_up_domain=domain,
        scale_up_bw_GBps=gpu.scale_up_bw_GBps,
        scale_out_bw_GBps=gpu.scale_out_bw_GBps,
    )


def tp_all_reduce_s(cluster: ClusterSpec, size_bytes: float, tp: int, params: ModelParams) -> float:
    """One all-reduce of ``size_bytes`` over the tp ranks. Inside an NVLink domain serving
    engines run a one-shot kernel for small messages (vLLM's and TensorRT-LLM's custom
    all-reduce, NCCL's NVLS): every rank reads the n - 1 peers' buffers at once, one hop of
    latency; NCCL's ring or tree is used where it is faster (large prefill messages) and
    across domains. A CPU host (gloo) has only the collective library's."""
    if tp <= 1 or size_bytes <= 0:
        return 0.0
    nccl = collective_time_s(cluster, "all_reduce", size_bytes, tp, 1, params)
    if cluster.gpu.host_is_device or tp > cluster.nvlink_domain:
        return nccl
    bw = cluster.scale_up_bw_GBps * params.scale_up_efficiency * 1e9
    one_shot = params.scale_up_latency_s + size_bytes * (tp - 1) / bw
    return min(nccl, one_shot)


def pp_hop_s(cluster: ClusterSpec, size_bytes: float, tp: int, params: ModelParams) -> float:
    """One pipeline hop of a step's activations (``size_bytes``), between stages on the next
    tp-sized block of GPUs (across nodes where a stage fills a node)."""
    if size_bytes <= 0:
        return 0.0
    cross = tp >= cluster.nvlink_domain
    return p2p_time_s(cluster, size_bytes, cross, params)


@cache
def _ll_table() -> dict[str, Any]:
    text = resources.files("aihpc.perf.infer").joinpath("data/deepep_ll.toml").read_text()
    return tomllib.loads(text)


def _ll_bandwidth(ep: int, column: int) -> float:
    """Published bytes per second per rank at ``ep``, log-linear between the measured EP
    sizes, the nearest measured one outside them."""
    rows = _ll_table()["rows"]
    if ep <= rows[0][0]:
        return float(rows[0][column])
    for lo, hi in itertools.pairwise(rows):
        if lo[0] <= ep <= hi[0]:
            t = (math.log(ep) - math.log(lo[0])) / (math.log(hi[0]) - math.log(lo[0]))
            return float(lo[column] + t * (hi[column] - lo[column]))
    return float(rows[-1][column])


def deepep_ll_s(
    cluster: ClusterSpec, tokens: float, hidden: int, top_k: int, ep: int, params: ModelParams
) -> tuple[float, float]:
    """(dispatch, combine) seconds of DeepEP's low-latency kernels for ``tokens`` decode tokens
    per rank: the published per-rank bandwidth at this EP size (deepep_ll.toml) scaled by the
    NIC against the H800's 50 GB/s, FP8 dispatch (with one 4-byte scale per 128 values) and
    BF16 combine; never below one network latency each."""
    if ep <= 1 or tokens <= 0:
        return 0.0, 0.0
    nic = _ll_table()["nic_GBps"]
    scale = cluster.scale_out_bw_GBps / nic
    copies = tokens * top_k * hidden
    dispatch = copies * (1 + 4 / 128) / (_ll_bandwidth(ep, 2) * 1e9 * scale)
    combine = copies * 2.0 / (_ll_bandwidth(ep, 4) * 1e9 * scale)
    floor = params.scale_out_latency_s
    return max(dispatch, floor), max(combine, floor)


@cache
def _normal_table() -> dict[str, Any]:
    text = resources.files("aihpc.perf.infer").joinpath("data/deepep_normal.toml").read_text()
    return tomllib.loads(text)


def _normal_bandwidth(ep: int, column: int) -> float:
    """DeepEP's published normal-kernel bottleneck bandwidth at ``ep`` (GB/s), log-linear
    between the measured internode sizes, the nearest one outside them."""
    rows = [r for r in _normal_table()["rows"] if r[0] > 8]
    if ep <= rows[0][0]:
        return float(rows[0][column])
    for lo, hi in itertools.pairwise(rows):
        if lo[0] <= ep <= hi[0]:
            t = (math.log(ep) - math.log(lo[0])) / (math.log(hi[0]) - math.log(lo[0]))
            return float(lo[column] + t * (hi[column] - lo[column]))
    return float(rows[-1][column])


def remote_nodes_per_token(model: ModelSpec, nodes: int) -> float:
    """Nodes other than its own that one token's top-k experts sit on, expected, with experts
    spread evenly over ``nodes``: uniform routing, or DeepSeek-V3's group-limited routing (the
    top-k drawn from topk_group of n_group groups, whole groups on a node)."""
    if nodes <= 1:
        return 0.0
    groups, pick = model.moe_router_groups, model.moe_router_group_topk
    if groups and pick and groups % nodes == 0:
        per_node = groups // nodes
        missed = math.comb(groups - per_node, pick) / math.comb(groups, pick)
    else:
        missed = (1.0 - 1.0 / nodes) ** model.moe_top_k
    return (nodes - 1) * (1.0 - missed)


def moe_normal_s(
    cluster: ClusterSpec, tokens: float, model: ModelSpec, ep: int, params: ModelParams
) -> tuple[float, float]:
    """(dispatch, combine) seconds of ``tokens`` prefill tokens per rank with DeepEP's normal
    kernels at their published bottleneck bandwidth (deepep_normal.toml): inside one node each
    token's top-k copies cross NVLink; across nodes a token crosses RDMA once per remote node
    it routes to (then NVLink forwarding), scaled by the NIC against the H800's 50 GB/s. FP8
    dispatch (a 4-byte scale per 128 values), BF16 combine."""
    if ep <= 1 or tokens <= 0:
        return 0.0, 0.0
    table, hidden = _normal_table(), model.hidden_size
    per_node = cluster.gpus_per_node
    if ep <= per_node:
        intra = table["rows"][0]
        scale = cluster.scale_up_bw_GBps / table["nvlink_GBps"] * 1e9
        copies = tokens * model.moe_top_k * (ep - 1) / ep * hidden
        return copies * (1 + 4 / 128) / (intra[1] * scale), copies * 2.0 / (intra[2] * scale)
    remote = tokens * remote_nodes_per_token(model, math.ceil(ep / per_node)) * hidden
    scale = cluster.scale_out_bw_GBps / table["nic_GBps"] * 1e9
    dispatch = remote * (1 + 4 / 128) / (_normal_bandwidth(ep, 1) * scale)
    combine = remote * 2.0 / (_normal_bandwidth(ep, 2) * scale)
    floor = params.scale_out_latency_s
    return max(dispatch, floor), max(combine, floor)


def kv_transfer_s(size_bytes: float, cluster: ClusterSpec, params: ModelParams) -> float:
    """A prompt's KV cache moved from a prefill instance to a decode one over the scale-out
    network (Mooncake's transfer engine, NIXL): RDMA at the NIC's bandwidth per GPU, every GPU
    of the instance sending its own shard."""
    if size_bytes <= 0:
        return 0.0
    bw = cluster.scale_out_bw_GBps * params.scale_out_efficiency * 1e9
    return params.scale_out_latency_s + size_bytes / bw
