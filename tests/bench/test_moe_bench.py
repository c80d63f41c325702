"""`aihpc bench moe` for real: 4 gloo ranks as 2 emulated nodes, every implementation checked
element by element, DeepEP's byte accounting, and the JSON fed to `aihpc calibrate`."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

torch = pytest.importorskip("torch")

from aihpc.bench.dist import launch_local  # noqa: E402
from aihpc.bench.moe import MoEBenchConfig, run_in_new_group  # noqa: E402
from aihpc.cli import app  # noqa: E402
from aihpc.runspec.calibration import load_calibration  # noqa: E402

pytestmark = pytest.mark.slow
runner = CliRunner()
TOKENS, HIDDEN, TOPK, EXPERTS = (32, 128), 64, 4, 16


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe") / "moe.json"
    args = ["bench", "moe", "--nproc-per-node", "4", "--ranks-per-node", "2", "--json"]
    args += ["--tokens", ",".join(map(str, TOKENS)), "--hidden", str(HIDDEN)]
    args += ["--topk", str(TOPK), "--experts", str(EXPERTS), "-n", "2", "-w", "1"]
    res = runner.invoke(app, [*args, "--output", str(out)])
    assert res.exit_code == 0, res.output[-2000:]
    return json.loads(out.read_text()), out


def test_every_implementation_delivers_exactly(doc):
    d, _ = doc
    rows = d["results"]
    assert [(r["tokens"], r["impl"]) for r in rows] == [
        (t, i) for t in TOKENS for i in ("ours", "ours_hier", "a2a_single")
    ]
    assert all(r["wrong"] == 0 for r in rows) and d["wrong_rows"] == 0


def test_bytes_and_bandwidth_as_deepep_counts_them(doc):
    d, _ = doc
    for r in d["results"]:
        t, bytes_per_token = r["tokens"], HIDDEN * 2  # bfloat16
        for phase in ("dispatch", "combine"):
            p = r[phase]
            assert p["GBps"] == pytest.approx(r["recv_bytes"] / 1e3 / p["time_us"])
            assert p["xnode_GBps"] == pytest.approx(r["xnode_bytes"] / 1e3 / p["time_us"])
        if r["impl"] == "a2a_single":  # one copy per (token, expert): exactly t * k rows
            assert r["recv_bytes"] == t * TOPK * bytes_per_token
        else:  # one copy per (token, rank): fewer, at least one per token
            assert t * bytes_per_token <= r["recv_bytes"] < t * TOPK * bytes_per_token
    by = {(r["tokens"], r["impl"]): r for r in d["results"]}
    for t in TOKENS:
        flat, hier, plain = by[(t, "ours")], by[(t, "ours_hier")], by[(t, "a2a_single")]
        assert flat["recv_bytes"] == hier["recv_bytes"]  # same rows delivered
        # across nodes: once per (token, node) < once per (token, rank) < once per (token, expert)
        assert hier["xnode_bytes"] < flat["xnode_bytes"] < plain["xnode_bytes"]
        # DeepEP's RDMA bytes: one row per (token, destination node), its own node included
        assert hier["xnode_bytes"] < hier["rdma_bytes"] <= 2 * t * bytes_per_token
        assert flat["rdma_bytes"] == 0


def test_results_calibrate_the_all_to_all(doc, tmp_path):
    d, path = doc
    points = d["calibration"]
    assert len(points) == 2 * len(TOKENS)  # ours: dispatch and combine per size
    assert {(p["collective"], p["tier"], p["num_ranks"]) for p in points} == {
        ("all_to_all", "scale_out", 4)
    }
    out = tmp_path / "c.toml"
    res = runner.invoke(app, ["calibrate", str(path), "-o", str(out), "--regimes", "1"])
    assert res.exit_code == 0, res.output
    fit = load_calibration(out).comm_fit("all_to_all", "scale_out")
    assert fit is not None and fit.num_ranks == 4 and fit.ranks_per_domain == 2
    assert fit.num_points == len(TOKENS)  # dispatch and combine of a size: one median point
    # the fit reproduces the median time of each size within its own reported error (two
    # sizes, one regime: the line passes through both medians)
    for size in {p["size_bytes"] for p in points}:
        times = sorted(p["time_us"] for p in points if p["size_bytes"] == size)
        median = sum(times) / 2  # two points per size: dispatch and combine
        reg = fit.regime(size)
        pred = reg.latency_us + size * 0.75 / reg.busbw_GBps / 1e3  # busbw factor (n-1)/n
        # the file keeps 6 significant digits per figure and the error to 4 decimals
        assert abs(pred - median) <= (fit.max_rel_error + 1e-4) * median


def test_a_wrong_element_is_counted():
    cfg = MoEBenchConfig(TOKENS[:1], HIDDEN, TOPK, EXPERTS, iters=1, warmup=0, corrupt_rank=1)
    for r in launch_local(2, run_in_new_group, cfg):
        # the element rank 1 spoiled, then the one token output it was summed into
        assert r.wrong == 2, r.impl


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--impl", "deepep"], "--impl"),
        (["--tokens", "12,x"], "--tokens"),
        (["--experts", "4", "--topk", "8"], "--experts"),
        (["-d", "int32"], "-d/--datatype"),
        (["--ranks-per-node", "3"], "--ranks-per-node"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, flag):
    res = runner.invoke(app, ["bench", "moe", "--nproc-per-node", "2", *args])
    assert res.exit_code == 2, res.output
    assert flag in res.output and "Traceback" not in res.output
