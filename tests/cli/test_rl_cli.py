"""aihpc rl estimate / search and aihpc validate --rl from the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parents[2] / "examples" / "rl"


def _run(*args):
    return subprocess.run([sys.executable, "-m", "aihpc", *args], capture_output=True, text=True)


def test_rl_estimate_json_has_every_phase():
    out = _run("rl", "estimate", str(EXAMPLES / "grpo_qwen3_30b_a3b_64h100.toml"), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    for phase in ("rollout", "old_logprob", "ref_logprob", "update", "weight_sync", "switch"):
        assert phase in data["phases_s"]
    assert data["step_time_s"] > 0


def test_rl_estimate_without_rl_is_exit_2(tmp_path):
    spec = tmp_path / "run.toml"
    spec.write_text(
        '[model]\npreset = "llama3-8b"\n[cluster]\ngpu = "h100-sxm"\nnum_gpus = 8\n'
        "[parallel]\nglobal_batch_size = 8\n"
    )
    out = _run("rl", "estimate", str(spec))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1


def test_bad_rl_field_is_exit_2(tmp_path):
    text = (EXAMPLES / "grpo_qwen3_30b_a3b_64h100.toml").read_text()
    spec = tmp_path / "run.toml"
    spec.write_text(text.replace('placement = "colocated"', "staleness = 2"))
    out = _run("rl", "estimate", str(spec))
    assert out.returncode == 2 and "rl.staleness" in out.stderr


def test_validate_rl_json_reports_each_set():
    out = _run("validate", "--rl", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert len(data["rows"]) >= 10
    assert all(r["source"] for r in data["rows"])
    assert set(data["mape"]) == {"dev", "heldout", "all"}
