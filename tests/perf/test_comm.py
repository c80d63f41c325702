"""Collective cost model: nccl-tests bus-bandwidth factors, tiers, calibration override."""

import pytest

from aihpc.perf.step.comm import busbw_factor, collective_time_s, group_tiers, p2p_time_s
from aihpc.perf.step.params import ModelParams
from aihpc.runspec import runspec_from_dict
from aihpc.runspec.calibration import calibration_from_dict
from aihpc.runspec.errors import SpecError


def cluster(n=64, gpu="h100-sxm"):
    return runspec_from_dict(
        {"model": {"preset": "llama3-8b"}, "cluster": {"gpu": gpu, "num_gpus": n}}
    ).cluster


@pytest.mark.parametrize(
    ("coll", "n", "factor"),
    [
        ("all_reduce", 8, 2 * 7 / 8),
        ("all_gather", 8, 7 / 8),
        ("reduce_scatter", 4, 3 / 4),
        ("all_to_all", 16, 15 / 16),
        ("broadcast", 8, 1.0),
        ("send_recv", 2, 1.0),
    ],
)
def test_busbw_factors(coll: str, n: int, factor: float) -> None:
    assert busbw_factor(coll, n) == pytest.approx(factor)


def test_group_tiers_follow_rank_order() -> None:
    c = cluster(64)
    assert group_tiers(c, 8, 1) == (8, 1)  # a TP group inside one node
    assert group_tiers(c, 8, 8) == (1, 8)  # a DP group with one member per node
    assert group_tiers(c, 16, 2) == (4, 4)  # two tiers


def test_large_intra_node_all_reduce_is_bandwidth_bound() -> None:
    c = cluster(8)
    p = ModelParams(scale_up_latency_s=0.0)
    size = 1 << 30
    t = collective_time_s(c, "all_reduce", size, 8, 1, p)
    expected = size * 2 * 7 / 8 / (c.scale_up_bw_GBps * 1e9 * p.scale_up_efficiency)
    assert t == pytest.approx(expected, rel=1e-9)


def test_hierarchical_is_faster_than_flat_scale_out() -> None:
    c = cluster(64)
    flat = collective_time_s(c, "all_reduce", 1 << 30, 8, 8)  # one GPU per node
    hier = collective_time_s(c, "all_reduce", 1 << 30, 64, 1)  # all 64 GPUs
    assert hier < flat * 1.0  # NVLink pre-reduction leaves 1/8 of the bytes for the NICs


def test_calibration_overrides_bandwidth() -> None:
    c = cluster(8)
    cal = calibration_from_dict(
        {
            "comm": [
                {
                    "collective": "all_reduce",
                    "tier": "scale_up",
                    "regimes": [{"latency_us": 0.0, "busbw_GBps": 100.0}],
                }
            ]
        }
    )
    size = 1e9
    t = collective_time_s(c, "all_reduce", size, 8, 1, calibration=cal)
    assert t == pytest.approx(size * 2 * 7 / 8 / 100e9, rel=1e-9)


def test_ring_latency_grows_with_ranks_tree_latency_with_log() -> None:
    """Tiny messages: an all-gather ring pays n-1 hops, a tree all-reduce 2 log2(n)."""
    c = cluster(1024)
    p = ModelParams()
    tiny = 8.0
    ag_16 = collective_time_s(c, "all_gather", tiny, 16, 8, p)
    ag_128 = collective_time_s(c, "all_gather", tiny, 128, 8, p)
    assert ag_128 / ag_16 == pytest.approx(127 / 15, rel=0.01)
    ar_16 = collective_time_s(c, "all_reduce", tiny, 16, 8, p)
    ar_128 = collective_time_s(c, "all_reduce", tiny, 128, 8, p)
    assert ar_128 / ar_16 == pytest.approx(7 / 4, rel=0.01)


def test_multi_node_fit_is_scaled_by_nics_per_group() -> None:
    """A scale-out fit measured over all 8 GPUs of each node (nccl-tests' usual run) holds 8 NICs
    per node; a DP group with one member per node has only its own NIC."""
    c = cluster(64)
    fit = {
        "collective": "all_reduce",
        "tier": "scale_out",
        "num_ranks": 16,
        "ranks_per_domain": 8,
        "regimes": [{"latency_us": 0.0, "busbw_GBps": 360.0}],
    }
    cal = calibration_from_dict({"comm": [fit]})
    size = 1 << 30
    whole = collective_time_s(c, "all_reduce", size, 64, 1, calibration=cal)  # 8 per node
    rail = collective_time_s(c, "all_reduce", size, 8, 8, calibration=cal)  # 1 per node
    assert whole == pytest.approx(size * 2 * 63 / 64 / 360e9, rel=1e-9)
    assert rail == pytest.approx(size * 2 * 7 / 8 / 360e9 * 8, rel=1e-9)


def test_multi_node_ring_passes_every_gpu() -> None:
    """NCCL's ring all-gather over N nodes of k GPUs has n - 1 steps, N - 1 of them across the
    network (its tuning model): n - N NVLink hops, not the k - 1 of one node."""
    c = cluster(1024)
    p = ModelParams()
    tiny = 8.0
    n, k = 256, 8
    nodes = n // k
    t = collective_time_s(c, "all_gather", tiny, n, 1, p)
    hops = (n - nodes) * p.scale_up_latency_s + (nodes - 1) * p.scale_out_latency_s
    assert t == pytest.approx(hops, rel=0.01)
    rs = collective_time_s(c, "reduce_scatter", tiny, n, 1, p)
    assert rs == pytest.approx(hops, rel=0.01)


def test_all_to_all_keeps_its_two_tier_latency() -> None:
    """Only the ring collectives count every NVLink hop of the ring; all-to-all does not."""
    c = cluster(1024)
    p = ModelParams()
    n, k = 256, 8
    t = collective_time_s(c, "all_to_all", 8.0, n, 1, p)
    assert t < (n - n // k) * p.scale_up_latency_s


@pytest.mark.parametrize("gpu", ["h100-sxm", "b200"])
def test_a_capped_communicator_moves_channels_times_the_channel_bandwidth(gpu: str) -> None:
    """One NCCL channel moves the part's measured per-channel figure (gpus.toml); a communicator
    capped to ``channels`` CTAs cannot beat that many, however wide the links."""
    c = cluster(8, gpu)
    p = ModelParams()
    per_channel = c.gpu.p2p_channel_bw_GBps
    assert per_channel is not None and per_channel < c.gpu.scale_up_bw_GBps / 8
    size = 16 << 20  # Llama 3 8B's K/V of 4,096 tokens, bf16
    free = p2p_time_s(c, size, False, p)
    one = p2p_time_s(c, size, False, p, channels=1)
    assert one == pytest.approx(p.scale_up_latency_s + size / (per_channel * 1e9), rel=1e-12)
    assert one > 10 * free
    assert p2p_time_s(c, size, False, p, channels=0) == free
    # Across nodes a channel moves NCCL's 14 GB/s sizing figure for network peers.
    net = p2p_time_s(c, size, True, p, channels=1)
    assert net == pytest.approx(p.scale_out_latency_s + size / 14e9, rel=1e-12)
    # Enough channels leave the link the bottleneck.
    assert p2p_time_s(c, size, False, p, channels=512) == free


def test_a_channel_cap_on_a_part_without_the_figure_is_refused() -> None:
    with pytest.raises(SpecError, match=r"p2p_channel_bw_GBps"):
        p2p_time_s(cluster(8, "mi300x"), 1 << 20, False, channels=1)
