"""`aihpc search` answers the user's question: ETTR when ranking by goodput, time to train a token
budget, and the best plan written as a run spec that estimate reads as it is."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aihpc.cli import app
from aihpc.runspec.tomlw import dumps_toml

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()
SPEC = (
    '[model]\npreset = "llama3-8b"\n[cluster]\ngpu = "h100-sxm"\nnum_gpus = 64\n'
    "{calibration}[parallel]\nglobal_batch_size = 128\n"
)


@pytest.fixture(scope="module")
def searched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    """One search with every new option: ranked by goodput, 15T tokens, best plan written to a
    different folder than the run spec's (whose calibration is a relative path)."""
    src, dst = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dst")
    (src / "cal.toml").write_text((ROOT / "examples" / "calibration-h100.toml").read_text())
    (src / "run.toml").write_text(SPEC.format(calibration='calibration = "cal.toml"\n'))
    args = ["search", str(src / "run.toml"), "--top", "4", "--rank-by", "goodput"]
    args += ["--tokens", "15T", "-o", str(dst / "plan.toml")]
    out = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    table = runner.invoke(app, args).stdout
    return dst / "plan.toml", out, table


def test_goodput_ranking_shows_ettr_and_time_to_train(searched) -> None:
    _, out, table = searched
    header = next(x for x in table.splitlines() if "tok/s/GPU" in x)
    assert " ETTR " in header and " days " in header and " M GPU-hours " in header
    goodputs = [p["goodput_tokens_per_s_per_gpu"] for p in out["plans"]]
    assert goodputs == sorted(goodputs, reverse=True)  # ranked by throughput x ETTR
    for p in out["plans"]:
        assert p["goodput_tokens_per_s_per_gpu"] == pytest.approx(
            p["tokens_per_s_per_gpu"] * p["ettr"], rel=1e-12
        )
        # days = tokens / (tokens per second x ETTR), from the plan's own step time
        rate = 128 * 8192 / p["step_time_s"] * p["ettr"]
        assert p["time_to_train_days"] == pytest.approx(15e12 / rate / 86400, rel=1e-9)
        assert p["gpu_hours"] == pytest.approx(p["time_to_train_days"] * 24 * 64, rel=1e-12)
    first = next(x for x in table.splitlines() if x.strip().startswith("1 "))
    assert f"{out['plans'][0]['ettr']:.1%}" in first
    assert f"{out['plans'][0]['time_to_train_days']:,.1f}" in first


def test_the_written_plan_is_the_best_and_estimate_reads_it(searched) -> None:
    path, out, table = searched
    assert out["output"] == str(path) and f"best plan written to {path}" in table
    data = tomllib.loads(path.read_text())
    assert data["parallel"] == out["plans"][0]["plan"]  # every field, not only those searched
    # the calibration path was rewritten relative to the new file's folder
    assert (path.parent / data["cluster"]["calibration"]).resolve().name == "cal.toml"
    res = runner.invoke(app, ["estimate", str(path), "--json"])
    assert res.exit_code == 0, res.output
    est = json.loads(res.stdout)
    assert est["tokens_per_s_per_gpu"] == out["plans"][0]["tokens_per_s_per_gpu"]
    assert est["calibration"]["used"]  # still priced with the measured figures
    assert path.read_text().startswith("# Written by `aihpc search ")


@pytest.mark.parametrize(
    ("output", "needle"), [("missing/plan.toml", "does not exist"), ("plan.json", ".toml")]
)
def test_output_is_checked_before_the_search(tmp_path: Path, output: str, needle: str) -> None:
    (tmp_path / "run.toml").write_text(SPEC.format(calibration=""))
    res = runner.invoke(app, ["search", str(tmp_path / "run.toml"), "-o", str(tmp_path / output)])
    assert res.exit_code == 2 and needle in res.stderr and "valid plans" not in res.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.toml"]


def test_toml_writer_round_trips() -> None:
    data = {
        "top": 1,
        "model": {"preset": "llama3-8b", "name": 'a "quoted"\\ name\n', "tied_embeddings": False},
        "cluster": {
            "gpu_spec": {"bf16_tflops": 989.0, "tiny": 1e-300, "big": float("inf")},
            "num_gpus": 64,
        },
        "reliability": {"failure_rates": {"gpu_hbm": 5e-06, "odd key": 2}},
        "lists": {"xs": [1, 2.5, "s", [3, 4]], "tables": [{"a": 1}, {"b": "c"}]},
        "empty": {},
    }
    assert tomllib.loads(dumps_toml(data, "header\nline two")) == data


def test_more_stages_than_layers_names_the_layer_rule(tmp_path: Path) -> None:
    """tiny-llama has 2 layers: a fixed pp = 4 is refused by the layer rule, as estimate
    refuses it, not reported as a memory problem ("no plan fits")."""
    spec = tmp_path / "pp.toml"
    spec.write_text(
        '[model]\npreset = "tiny-llama"\n[cluster]\ngpu = "h100-sxm"\nnum_gpus = 4\n'
        "[parallel]\npp = 4\nglobal_batch_size = 16\n"
    )
    said = {}
    for command in ("search", "estimate"):
        r = runner.invoke(app, [command, str(spec)])
        assert r.exit_code == 2, r.output
        said[command] = r.stderr.strip()
    assert len(said["search"].splitlines()) == 1 and "no plan fits" not in said["search"]
    assert said["search"] == said["estimate"]
