"""Collective cost model: hierarchical (scale-up domain, then scale-out), latency + bandwidth with
nccl-tests' bus-bandwidth factors (nccl-tests doc/PERFORMANCE.md).

Sizes are the whole-buffer size S of nccl-tests: the all-reduce buffer, the all-gather *output*,
the reduce-scatter *input*. ``time = steps x latency + S x factor(n) / busbw`` where busbw is the
link bandwidth times a named efficiency, or the measured busbw of a calibration file.

Rank placement follows Megatron-LM's order (tp innermost, then cp, then dp, then pp): a group of
``n`` ranks with ``stride`` between members keeps ``k = domain // stride`` members inside one
scale-up domain; when 1 < k < n the collective runs in two tiers (NCCL's NVLS/tree and
hierarchical algorithms do the same): inside the domain over NVLink on S, across domains over the
NICs on S / k, every GPU driving its own NIC (rail-optimised fabric). A multi-node all-gather or
reduce-scatter is one NCCL ring through every GPU: its latency counts n - domains NVLink hops and
domains - 1 network hops.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from aihpc.perf.step.params import DEFAULT_PARAMS, ModelParams
from aihpc.runspec.calibration import Calibration, busbw_factor
from aihpc.runspec.cluster import ClusterSpec
from aihpc.runspec.errors import SpecError

__all__ = [
    "busbw_factor",
    "collective_time_s",
    "collective_times_s",
    "group_tiers",
    "moe_all_to_all_time_s",
    "moe_kernel_a2a_time_s",
    "p2p_time_s",
    "remote_domains_per_token",
]


def group_tiers(cluster: ClusterSpec, n: int, stride: int, reach: int = 0) -> tuple[int, int]:
    """(members per scale-up domain, number of domains spanned) for a group of n ranks;
    ``reach`` > 0: a kernel that reaches at most that many ranks over NVLink (torchtitan's
    DeepEP: 8)."""
    domain = min(cluster.nvlink_domain, reach) if reach else cluster.nvlink_domain
    k = min(n, domain // stride) if stride < domain else 1
    k = max(1, k)
    return k, math.ceil(n / k)


def _tier_figures(
    cluster: ClusterSpec, tier: str, params: ModelParams, calibration: Calibration | None
) -> tuple[float, float]:
    """(bus bandwidth in GB/s, latency per hop in s) of a tier from the cluster's figures, with
    the scale fitted to measured runs where the calibration has one (aihpc calibrate --runs)."""
    if tier == "scale_up":
        bw = cluster.scale_up_bw_GBps * params.scale_up_efficiency
        latency = params.scale_up_latency_s
    else:
        bw = cluster.scale_out_bw_GBps * params.scale_out_efficiency
        latency = params.scale_out_latency_s
    if calibration is not None:
        bw *= calibration.scale(tier)
    return bw, latency


def _tier_time_s(
    cluster: ClusterSpec,
    collective: str,
    size_bytes: float,
    n: int,
    tier: str,
    params: ModelParams,
    calibration: Calibration | None,
    channels: int = 0,
) -> float:
    if n <= 1 or size_bytes <= 0:
        return 0.0
    factor = busbw_factor(collective, n)
    # A point-to-point transfer on a communicator capped at c CTAs moves at most c channels'
    # worth (callers pass channels for send_recv only: a ring collective's channel moves more).
    cap = (
        channels * _channel_bw_GBps(cluster, params, tier == "scale_out", channels)
        if channels > 0
        else float("inf")
    )
    fit = calibration.comm_fit(collective, tier) if calibration is not None else None
    if fit is not None:
        r = fit.regime(size_bytes)
        return r.latency_us * 1e-6 + size_bytes * factor / (min(r.busbw_GBps, cap) * 1e9)
    bw, latency = _tier_figures(cluster, tier, params, calibration)
    bw = min(bw, cap)
    # Latency: NCCL runs all-gather and reduce-scatter as rings, n - 1 dependent hops; an
    # all-reduce at scale uses the double binary tree, 2 log2(n) hops (Sanders et al. 2009;
    # NCCL 2.4 release notes); all-to-all and point-to-point pay one hop per peer exchange.
    if collective in ("all_gather", "reduce_scatter"):
        steps = n - 1
    elif collective == "all_reduce":
        steps = 2 * math.ceil(math.log2(n))
    else:
        steps = 1
    return steps * latency + size_bytes * factor / (bw * 1e9)


def collective_time_s(
    cluster: ClusterSpec,
    collective: str,
    size_bytes: float,
    n: int,
    stride: int = 1,
    params: ModelParams | None = None,
    calibration: Calibration | None = None,
) -> float:
    """Time of one collective of whole-buffer ``size_bytes`` over ``n`` ranks ``stride`` apart."""
    params = params or DEFAULT_PARAMS
    calibration = calibration if calibration is not None else cluster.calibration
    if n <= 1:
        return 0.0
    k, domains = group_tiers(cluster, n, stride)
    if domains == 1:
        return _tier_time_s(cluster, collective, size_bytes, n, "scale_up", params, calibration)
    fit = calibration.comm_fit(collective, "scale_out") if calibration is not None else None
    if fit is not None and fit.ranks_per_domain != 1:
        # The fit timed a whole multi-node collective (nccl-tests over every GPU of the nodes):
        # its busbw already holds the NVLink phase and k_m NICs per node sharing the bytes. A
        # group with k members per domain spreads the inter-node bytes over k NICs instead.
        k_measured = fit.ranks_per_domain or k
        r = fit.regime(size_bytes)
        bw_time = size_bytes * busbw_factor(collective, n) / (r.busbw_GBps * 1e9)
        return r.latency_us * 1e-6 + bw_time * k_measured / k
    if k == 1:
        return _tier_time_s(cluster, collective, size_bytes, n, "scale_out", params, calibration)
    up = _tier_time_s(
        cluster,
        "reduce_scatter" if collective != "all_gather" else "all_gather",
        size_bytes,
        k,
        "scale_up",
        params,
        calibration,
    )
    out = _tier_time_s(
        cluster, collective, size_bytes / k, domains, "scale_out", params, calibration
    )
    if collective == "all_reduce":  # reduce-scatter in, all-reduce across, all-gather out
        up *= 2
    elif collective in ("all_gather", "reduce_scatter") and (
        calibration is None or calibration.comm_fit(collective, "scale_up") is None
    ):
        # NCCL runs a multi-node all-gather or reduce-scatter as one ring through all n ranks
        # (its tuning model, graph/tuning.cc: n - 1 steps, nNodes of them over the network):
        # the bytes spread over every NIC as the two tiers above say, but the ring has
        # n - domains NVLink hops, not the k - 1 of one domain.
        up += (n - domains - (k - 1)) * params.scale_up_latency_s
    return up + out


def p2p_time_s(
    cluster: ClusterSpec,
    size_bytes: float,
    cross_domain: bool,
    params: ModelParams | None = None,
    calibration: Calibration | None = None,
    channels: int = 0,
) -> float:
    """One point-to-point transfer (pipeline stages, ring attention).

    ``channels`` > 0: the communicator may use at most that many NCCL channels (CTAs), each
    moving ``p2p_channel_bw_GBps`` over NVLink or ``net_p2p_channel_bw_GBps`` across the network;
    the transfer runs at the lower of that and the link's bandwidth.
    """
    params = params or DEFAULT_PARAMS
    calibration = calibration if calibration is not None else cluster.calibration
    tier = "scale_out" if cross_domain else "scale_up"
    return _tier_time_s(cluster, "send_recv", size_bytes, 2, tier, params, calibration, channels)


def _channel_bw_GBps(
    cluster: ClusterSpec, params: ModelParams, cross_domain: bool, channels: int
) -> float:
    """What one NCCL channel (one CTA) moves to a peer, per direction, GB/s."""
    if cross_domain:
        return params.net_p2p_channel_bw_GBps
    if cluster.gpu.p2p_channel_bw_GBps is None:
        raise SpecError(
            "cluster.gpu_spec.p2p_channel_bw_GBps",
            None,
            f"GPU {cluster.gpu.id!r} has no figure, and a communicator's CTAs are capped at "
            f"{channels}: set it, or leave the training.*_comm_ctas caps at 0",
        )
    return cluster.gpu.p2p_channel_bw_GBps


def remote_domains_per_token(
    domains: int, top_k: int, groups: int = 0, group_topk: int = 0
) -> float:
    """Scale-up domains other than its own that one token's top-k experts lie in, on average.

    Experts are spread evenly over the EP ranks and the balanced routing the benchmarks force
    picks them uniformly, so k picks over D domains touch D (1 - (1 - 1/D)^k) distinct domains.
    Group-limited routing (DeepSeek-V3's node-limited routing: experts in ``groups`` contiguous
    groups, a token's experts from its best ``group_topk`` of them, sec. 2.1.2) caps that at
    group_topk x D / groups domains when a group spans several domains, at group_topk when a
    domain holds several groups. The token's own domain is one of those touched with
    probability 1/D per domain: (D - 1) / D of them are remote."""
    if domains <= 1:
        return 0.0
    touched = domains * (1 - (1 - 1 / domains) ** top_k)
    if groups and group_topk:
        cap = group_topk * max(1.0, domains / groups)
        touched = min(touched, cap, float(domains))
    return touched * (domains - 1) / domains


def moe_all_to_all_time_s(
    cluster: ClusterSpec,
    copies_bytes: float,
    token_bytes: float,
    n: int,
    stride: int,
    hierarchical: bool,
    remote_domains: float,
    params: ModelParams | None = None,
    reach: int = 0,
) -> float:
    """One MoE dispatch (or combine) over an EP group of ``n`` ranks ``stride`` apart.

    ``copies_bytes``: what one rank's routed token copies weigh (tokens x top_k x hidden x
    bytes); ``token_bytes``: the same tokens once each. The NVLink and the network phases run
    at once (both DeepEP's normal kernels and NCCL's all-to-all drive the two fabrics
    concurrently), so the time is the slower of them plus one latency of each.

    alltoall (flat, NCCL): each copy travels on its own; (k - 1) / n of them stay in the
    rank's scale-up domain of k members, (n - k) / n cross the NIC.
    hierarchical (DeepEP normal kernels, HybridEP): a token crosses the network once per
    remote domain it needs (``remote_domains``), to the peer of the same local index, which
    forwards it over NVLink to the experts there; the NVLink phase carries the copies bound for
    other ranks of each domain, (k - 1) / k of them."""
    params = params or DEFAULT_PARAMS
    if n <= 1 or copies_bytes <= 0:
        return 0.0
    k, domains = group_tiers(cluster, n, stride, reach)
    up_bw = cluster.scale_up_bw_GBps * params.scale_up_efficiency * 1e9
    out_bw = cluster.scale_out_bw_GBps * params.scale_out_efficiency * 1e9
    up_lat, out_lat = params.scale_up_latency_s, params.scale_out_latency_s
    cal = cluster.calibration
    if cal is not None:  # scales fitted to measured runs (aihpc calibrate --runs)
        up_bw, out_bw = up_bw * cal.scale("scale_up"), out_bw * cal.scale("scale_out")
    # A calibration's all-to-all fit (aihpc bench moe / nccl-tests alltoall_perf, through
    # aihpc calibrate) replaces the bus bandwidth and latency of its tier.
    for tier in ("scale_up", "scale_out"):
        fit = cal.comm_fit("all_to_all", tier) if cal is not None else None
        if fit is not None:
            r = fit.regime(copies_bytes)
            if tier == "scale_up":
                up_bw, up_lat = r.busbw_GBps * 1e9, r.latency_us * 1e-6
            else:
                out_bw, out_lat = r.busbw_GBps * 1e9, r.latency_us * 1e-6
    if domains == 1:
        return up_lat + copies_bytes * (n - 1) / n / up_bw
    if hierarchical:
        intra = copies_bytes * (k - 1) / k
        inter = token_bytes * remote_domains
    else:
        intra = copies_bytes * (k - 1) / n
        inter = copies_bytes * (n - k) / n
    return up_lat + out_lat + max(intra / up_bw, inter / out_bw)


def moe_kernel_a2a_time_s(
    cluster: ClusterSpec,
    kernel: str,
    sms: int,
    column: str,
    token_bytes: float,
    top_k: int,
    n: int,
    stride: int,
    reach: int,
    group_limit: tuple[int, int],
    params: ModelParams | None = None,
) -> float | None:
    """One dispatch or combine (``column``: dispatch_fp8, dispatch_bf16, combine) of a
    deduplicating kernel (DeepEP's normal kernels, HybridEP) at its published bandwidth
    (perf/step/moe_stack.py), or None where neither tier has a figure for this part, or the
    calibration fitted the cluster's own all-to-all (the caller prices it as before).

    ``token_bytes``: one rank's tokens once each. A rank receives one row per (token, rank) its
    experts lie on over NVLink and one per (token, NVLink group) over RDMA (the kernels' own
    byte counts); a tier without a figure runs at the link efficiency of the other collectives.
    ``group_limit``: (groups, groups per token) of node-limited routing, (0, 0) for none."""
    from aihpc.perf.step.moe_stack import kernel_GBps, ranks_touched

    params = params or DEFAULT_PARAMS
    cal = cluster.calibration
    if n <= 1 or token_bytes <= 0:
        return 0.0
    if cal is not None and any(cal.comm_fit("all_to_all", t) for t in ("scale_up", "scale_out")):
        return None
    k, domains = group_tiers(cluster, n, stride, reach)
    groups, per_token = group_limit
    cap = per_token * max(1.0, domains / groups) if groups and per_token else 0.0
    d, r = ranks_touched(n, top_k, domains, cap)
    gpu = cluster.gpu.id
    nvl = kernel_GBps(kernel, gpu, "nvlink", k, sms, column, cluster.scale_up_bw_GBps)
    rdma = kernel_GBps(kernel, gpu, "rdma", n, sms, column, cluster.scale_out_bw_GBps)
    if nvl is None and (domains == 1 or rdma is None):
        return None
    # A tier without a figure moves only the rows bound elsewhere, at the link efficiency.
    if nvl is None:
        nvl, r = cluster.scale_up_bw_GBps * params.scale_up_efficiency, r * (k - 1) / k
    t = params.scale_up_latency_s + token_bytes * r / (nvl * 1e9)
    if domains > 1:
        if rdma is None:
            rdma = cluster.scale_out_bw_GBps * params.scale_out_efficiency
            d *= (domains - 1) / domains
        t = max(t, token_bytes * d / (rdma * 1e9)) + params.scale_out_latency_s
    return t


def _tier_times_s(
    cluster: ClusterSpec,
    collective: str,
    size_bytes: np.ndarray,
    n: np.ndarray,
    tier: str,
    params: ModelParams,
    calibration: Calibration | None,
) -> np.ndarray:
    """``_tier_time_s`` over arrays of sizes and group sizes (no CTA cap: collectives only)."""
    n_f = n.astype(float)
    if collective == "all_reduce":
        factor = 2.0 * (n_f - 1) / n_f
    elif collective in ("all_gather", "reduce_scatter", "all_to_all"):
        factor = (n_f - 1) / n_f
    else:
        factor = busbw_factor(collective, 2) + 0 * n_f
    fit = calibration.comm_fit(collective, tier) if calibration is not None else None
    if fit is not None:
        latency_us, busbw = _regimes(fit, size_bytes)
        out = latency_us * 1e-6 + size_bytes * factor / (busbw * 1e9)
    else:
        bw, latency = _tier_figures(cluster, tier, params, calibration)
        if collective in ("all_gather", "reduce_scatter"):
            steps = n - 1
        elif collective == "all_reduce":
            steps = 2 * np.ceil(np.log2(np.maximum(n_f, 1.0)))
        else:
            steps = np.ones(len(n))
        out = steps * latency + size_bytes * factor / (bw * 1e9)
    return np.where((n <= 1) | (size_bytes <= 0), 0.0, out)


def _regimes(fit: Any, size_bytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(latency_us, busbw_GBps) of the regime each size falls in (``CommFit.regime``)."""
    latency = np.full(len(size_bytes), fit.regimes[-1].latency_us)
    busbw = np.full(len(size_bytes), fit.regimes[-1].busbw_GBps)
    for r in reversed(fit.regimes):
        inside = size_bytes <= r.max_bytes
        latency = np.where(inside, r.latency_us, latency)
        busbw = np.where(inside, r.busbw_GBps, busbw)
    return latency, busbw


def collective_times_s(
    cluster: ClusterSpec,
    collective: str,
    size_bytes: Any,
    n: Any,
    stride: Any,
    params: ModelParams | None = None,
) -> np.ndarray:
    """``collective_time_s`` over numpy arrays of sizes, group sizes and strides (the search
    prices every plan's data-parallel collectives at once); the cluster's own calibration."""
    params = params or DEFAULT_PARAMS
    calibration = cluster.calibration
    size_bytes, n, stride = np.broadcast_arrays(
        np.asarray(size_bytes, dtype=float), np.asarray(n), np.asarray(stride)
    )
    domain = cluster.nvlink_domain
    k = np.where(stride < domain, np.minimum(n, domain // stride), 1)
    k = np.maximum(1, k)
    domains = -(-n // k)
    up_only = _tier_times_s(cluster, collective, size_bytes, n, "scale_up", params, calibration)
    out = up_only
    multi = domains > 1
    if multi.any():
        out = np.where(
            multi, _multi_domain(cluster, collective, size_bytes, n, k, domains, params), out
        )
    return np.where(n <= 1, 0.0, out)


def _multi_domain(
    cluster: ClusterSpec,
    collective: str,
    size_bytes: np.ndarray,
    n: np.ndarray,
    k: np.ndarray,
    domains: np.ndarray,
    params: ModelParams,
) -> np.ndarray:
    """The collective of ``collective_time_s`` that spans several scale-up domains."""
    calibration = cluster.calibration
    fit = calibration.comm_fit(collective, "scale_out") if calibration is not None else None
    if fit is not None and fit.ranks_per_domain != 1:
        k_measured = fit.ranks_per_domain or k
        latency_us, busbw = _regimes(fit, size_bytes)
        n_f = n.astype(float)
        factor = 2.0 * (n_f - 1) / n_f if collective == "all_reduce" else (n_f - 1) / n_f
        bw_time = size_bytes * factor / (busbw * 1e9)
        return latency_us * 1e-6 + bw_time * k_measured / k
    flat = _tier_times_s(cluster, collective, size_bytes, n, "scale_out", params, calibration)
    inner = "reduce_scatter" if collective != "all_gather" else "all_gather"
    up = _tier_times_s(cluster, inner, size_bytes, k, "scale_up", params, calibration)
    out = _tier_times_s(
        cluster, collective, size_bytes / k, domains, "scale_out", params, calibration
    )
    if collective == "all_reduce":
        up = up * 2
    elif collective in ("all_gather", "reduce_scatter") and (
        calibration is None or calibration.comm_fit(collective, "scale_up") is None
    ):
        up = up + (n - domains - (k - 1)) * params.scale_up_latency_s
    return np.where(k == 1, flat, up + out)
