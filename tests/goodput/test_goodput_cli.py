"""``aihpc goodput``: JSON keys, human output, plot, and exit code 2 with one line on bad input."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aihpc.cli import app

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "llama3-405b-16k.toml"
runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, ["goodput", *map(str, args)])


def test_json_keys_and_llama3_figures():
    res = run(EXAMPLE, "--step-time", "10", "--days", "54", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    for key in ("mtbf_s", "expected_interruptions", "optimal_checkpoint_interval_s", "ettr"):
        assert isinstance(out[key], float)
    assert "time_to_train_days" not in out
    assert abs(out["expected_interruptions"] - 466) / 466 < 0.10  # Llama 3 §3.3.4
    assert out["ettr"] > 0.90


def test_tokens_adds_time_to_train():
    res = run(EXAMPLE, "--step-time", "10", "--tokens", "15.6T", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["tokens"] == pytest.approx(15.6e12)
    assert out["time_to_train_days"] > 0
    assert out["days"] == pytest.approx(out["time_to_train_days"])


def test_human_output_names_the_dominant_loss():
    res = run(EXAMPLE, "--step-time", "10", "--strategy", "sync")
    assert res.exit_code == 0, res.output
    assert "ETTR" in res.stdout and "dominates the lost time" in res.stdout


def test_estimate_supplies_the_step_time():
    pytest.importorskip("aihpc.perf.step.estimate")
    res = run(EXAMPLE, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["step_time_s"] > 0


def test_plot_is_written_atomically(tmp_path):
    target = tmp_path / "goodput.png"
    res = run(EXAMPLE, "--step-time", "10", "--plot", target, "--json")
    assert res.exit_code == 0, res.output
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["goodput.png"]  # no temp file left


def _bad(res, field: str) -> None:
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and field in lines[0], res.output


def test_negative_days_and_bad_tokens():
    _bad(run(EXAMPLE, "--step-time", "10", "--days", "-3"), "--days")
    _bad(run(EXAMPLE, "--step-time", "10", "--tokens", "lots"), "--tokens")
    _bad(run(EXAMPLE, "--step-time", "10", "--strategy", "tape"), "--strategy")


def test_bad_reliability_field(tmp_path):
    spec = tmp_path / "run.toml"
    spec.write_text(EXAMPLE.read_text() + "\n[reliability]\nfailure_rate_scale = -2\n")
    _bad(run(spec, "--step-time", "10"), "reliability.failure_rate_scale")
    spec.write_text(EXAMPLE.read_text() + "\n[reliability]\nmtbf_hours = 3\n")
    _bad(run(spec, "--step-time", "10"), "reliability.mtbf_hours")


def test_bad_plot_path(tmp_path):
    _bad(run(EXAMPLE, "--step-time", "10", "--plot", tmp_path / "missing" / "x.png"), "--plot")
    _bad(run(EXAMPLE, "--step-time", "10", "--plot", tmp_path / "x.jpg"), "--plot")
    _bad(run(EXAMPLE, "--step-time", "10", "--plot", tmp_path), "--plot")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_plot_directory(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        _bad(run(EXAMPLE, "--step-time", "10", "--plot", locked / "x.png"), "--plot")
    finally:
        locked.chmod(0o700)
        shutil.rmtree(locked)


def test_estimate_and_search_carry_goodput(tmp_path):
    pytest.importorskip("aihpc.perf.search.ranking")
    res = runner.invoke(app, ["estimate", str(EXAMPLE), "--json"])
    assert res.exit_code == 0, res.output
    est = json.loads(res.stdout)
    g = est["goodput"]
    for key in ("mtbf_s", "expected_interruptions", "optimal_checkpoint_interval_s", "ettr"):
        assert isinstance(g[key], float)
    assert g["step_time_s"] == pytest.approx(est["step_time_s"])
    spec = tmp_path / "search.toml"
    spec.write_text(
        '[model]\npreset = "llama3-405b"\nnum_layers = 128\n'
        '[cluster]\ngpu = "h100-sxm"\nnum_gpus = 16384\ngpus_per_node = 8\n'
        "[parallel]\ntp = 8\npp = 16\nmicro_batch_size = 1\nglobal_batch_size = 2048\n"
        "[reliability]\nmtbf_s = 600\n"
    )
    res = runner.invoke(app, ["search", str(spec), "--rank-by", "goodput", "--json", "--top", "8"])
    assert res.exit_code == 0, res.output
    plans = json.loads(res.stdout)["plans"]
    goodput = [p["tokens_per_s_per_gpu"] * p["ettr"] for p in plans]
    assert plans and goodput == sorted(goodput, reverse=True)
    assert all(0 < p["ettr"] < 1 for p in plans)


def test_human_output_prints_table_names_as_written(tmp_path):
    """Notes are text, not rich markup: the override source reads "[reliability] mtbf_s"."""
    spec = tmp_path / "run.toml"
    spec.write_text(EXAMPLE.read_text() + "\n[reliability]\nmtbf_s = 600000\n")
    res = run(spec, "--step-time", "10")
    assert res.exit_code == 0, res.output
    assert "[reliability]" in res.stdout  # one token: the table may wrap the note


def test_strategy_compare_json_has_every_strategy_at_each_gpu_count():
    res = run(EXAMPLE, "--strategy", "compare", "--gpus", "16384,100000", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["gpu_counts"] == [16384, 100000] and out["measured"] is None
    for n in ("16384", "100000"):
        row = out["results"][n]
        assert list(row) == ["sync", "async", "in_memory", "inprocess"]
        for d in row.values():
            assert 0 < d["ettr"] < 1
            assert sum(d["lost_time_fraction"].values()) == pytest.approx(1 - d["ettr"])
            assert set(d["lost_time_fraction"]) == {
                "checkpoint",
                "lost_work",
                "detection",
                "restart",
                "restore",
                "planned",
            }
    assert out["results"]["100000"]["sync"]["ettr"] < out["results"]["16384"]["sync"]["ettr"]


def test_strategy_compare_reads_measured_figures_and_labels_them(tmp_path):
    doc = {"paths": {"inprocess_exception": {"detection_s": 0.5, "restart_s": 2.0}}}
    (tmp_path / "r.json").write_text(json.dumps(doc))
    res = run(EXAMPLE, "--strategy", "compare", "--measured", tmp_path / "r.json", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    path = out["results"]["16384"]["inprocess"]["paths"]["exception"]
    assert path["restart_s"] == 2.0
    assert path["restart_source"] == "measured: r.json paths.inprocess_exception.restart_s"
    assert out["mixed_sources"] is True  # the relaunch figures are still the published ones
    human = run(EXAMPLE, "--strategy", "compare", "--measured", tmp_path / "r.json")
    assert human.exit_code == 0 and "mix measured and published" in human.stdout


def test_strategy_compare_reads_this_repo_s_recovery_benchmark():
    measured = ROOT / "benchmarks" / "results" / "recovery_time.json"
    res = run(EXAMPLE, "--strategy", "compare", "--measured", measured, "--json")
    assert res.exit_code == 0, res.output
    paths = json.loads(res.stdout)["results"]["16384"]["inprocess"]["paths"].values()
    sources = [p[k] for p in paths for k in ("detection_source", "restart_source")]
    assert any(s.startswith("measured: recovery_time.json") for s in sources)


def test_strategy_compare_bad_input(tmp_path):
    _bad(run(EXAMPLE, "--strategy", "compare", "--gpus", "lots"), "--gpus")
    _bad(run(EXAMPLE, "--strategy", "compare", "--gpus", "0"), "--gpus")
    _bad(run(EXAMPLE, "--strategy", "compare", "--correlated-loss", "2"), "--correlated-loss")
    _bad(run(EXAMPLE, "--strategy", "compare", "--measured", tmp_path / "no.json"), "--measured")
    (tmp_path / "bad.json").write_text('{"paths": {"agent_storage": {"restart_s": -1}}}')
    _bad(run(EXAMPLE, "--strategy", "compare", "--measured", tmp_path / "bad.json"), "--measured")
    _bad(run(EXAMPLE, "--step-time", "10", "--gpus", "1024"), "--gpus")
    _bad(run(EXAMPLE, "--strategy", "compare", "--gpus", "1001"), "num_gpus")
