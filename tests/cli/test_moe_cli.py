"""MoE through the CLI (issue 17): `aihpc validate --moe`, a search whose only obstacle is an
expert-parallel rule, and an estimate that shows the MoE plan fields."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from aihpc.cli import app


def test_validate_moe_reports_its_own_targets() -> None:
    runner = CliRunner()
    r = runner.invoke(app, ["validate", "--moe", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["moe"] is True and len(data["rows"]) == 13
    assert data["targets"] == {"mape": 0.15, "max_abs_error": 0.30}
    assert all(row["predicted_tokens_per_s_per_gpu"] > 0 for row in data["rows"])
    text = runner.invoke(app, ["validate", "--moe"]).stdout.strip().splitlines()[-1]
    assert text.startswith("MoE targets (issue 17)")
    for row in data["rows"]:
        if abs(row["error"]) > 0.30:
            assert row["id"] in text


def test_validate_moe_is_its_own_set() -> None:
    r = CliRunner().invoke(app, ["validate", "--moe", "--heldout"])
    assert r.exit_code == 2 and "--moe" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_search_names_the_ep_rule(tmp_path: Path) -> None:
    """Mixtral has 8 experts: ep = 16 is refused by the EP rule, not by memory."""
    spec = tmp_path / "moe.toml"
    spec.write_text(
        '[model]\npreset = "mixtral-8x7b"\n\n[cluster]\ngpu = "h100-sxm"\nnum_gpus = 16\n\n'
        "[parallel]\nglobal_batch_size = 256\nep = 16\n"
    )
    r = CliRunner().invoke(app, ["search", str(spec)])
    assert r.exit_code == 2, r.output
    assert "parallel.ep" in r.stderr and "EP rule" in r.stderr
    assert "no plan fits" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_estimate_shows_the_moe_plan(tmp_path: Path) -> None:
    spec = tmp_path / "ds.toml"
    spec.write_text(
        '[model]\npreset = "deepseek-v3"\n\n[cluster]\ngpu = "h800"\nnum_gpus = 2048\n\n'
        "[parallel]\ntp = 1\npp = 16\nep = 64\nmicro_batch_size = 1\nglobal_batch_size = 15360\n"
        'moe_a2a_overlap = "dualpipe"\nrecompute_modules = ["layernorm", "mla_up_proj"]\n\n'
        '[training]\nprecision = "fp8"\nmoe_dispatcher = "hierarchical"\n'
    )
    r = CliRunner().invoke(app, ["estimate", str(spec)])
    assert r.exit_code in (0, 1), r.output  # 1: priced, but over 80 GiB
    assert "ep 64" in r.stdout and "a2a overlap dualpipe" in r.stdout
    assert "MoE dispatch hierarchical" in r.stdout
    j = CliRunner().invoke(app, ["estimate", str(spec), "--json"])
    out = json.loads(j.stdout)
    assert out["plan"]["recompute_modules"] == ["layernorm", "mla_up_proj"]
    assert "ep_comm" in out["time_s"]
