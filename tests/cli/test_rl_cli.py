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


BAD = [-1, 0, 3, 2**40, 2**63 - 1, 0.5, 1e308, float("inf"), float("nan"), "abc", "", True]


def _value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v != v:
        return "nan"
    if isinstance(v, float) and v in (float("inf"), float("-inf")):
        return "inf"
    return json.dumps(v)


def test_every_rl_field_and_bad_value_is_an_answer_or_one_line(tmp_path):
    """Each [rl] / [rl.rollout] field set to wrong kinds and absurd magnitudes: exit 0 or 1
    with an answer, or exit 2 with one line; never a traceback or a hang."""
    from dataclasses import fields

    from typer.testing import CliRunner

    from aihpc.cli import app
    from aihpc.runspec.rl import RLSpec, RolloutSpec

    base = (EXAMPLES / "grpo_qwen3_30b_a3b_64h100.toml").read_text()
    head, rollout = base.split("[rl.rollout]")
    runner, path, refused = CliRunner(), tmp_path / "run.toml", 0
    cases = [("rl", f.name) for f in fields(RLSpec) if f.name != "rollout"]
    cases += [("rl.rollout", f.name) for f in fields(RolloutSpec)]
    for section, name in cases:
        for value in BAD:
            line = f"{name} = {_value(value)}\n"
            lines = [x for x in head.splitlines() if not x.startswith(f"{name} =")]
            text = "\n".join(lines) + "\n"
            if section == "rl":
                text += line + "[rl.rollout]" + rollout
            else:
                kept = [x for x in rollout.splitlines() if not x.startswith(f"{name} =")]
                text += "[rl.rollout]" + "\n".join(kept) + "\n" + line
            path.write_text(text)
            res = runner.invoke(app, ["rl", "estimate", str(path), "--json"])
            case = f"[{section}] {name} = {value!r}"
            assert res.exit_code in (0, 1, 2), f"{case}: exit {res.exit_code}\n{res.output}"
            if res.exit_code == 2:
                refused += 1
                out = res.stderr.strip().splitlines()
                assert len(out) == 1 and out[0].startswith("error: "), f"{case}: {out}"
            else:
                assert json.loads(res.stdout)["step_time_s"] > 0, case
    assert refused > len(cases) * len(BAD) // 2


def test_rl_search_writes_its_fastest_layout_as_a_run_spec(tmp_path):
    out = tmp_path / "best.toml"
    res = _run("rl", "search", str(EXAMPLES / "grpo_qwen3_30b_a3b_64h100.toml"), "-o", str(out))
    assert res.returncode == 0, res.stderr
    first = next(line for line in res.stdout.splitlines() if line.startswith("1. "))
    step = float(first.split(" step ")[1].split(" s")[0])
    again = json.loads(_run("rl", "estimate", str(out), "--json").stdout)
    assert abs(again["step_time_s"] - step) < 0.05  # the file prices as the search did


def test_rl_estimate_steps_gives_the_runs_time():
    out = _run("rl", "estimate", str(EXAMPLES / "grpo_qwen3_30b_a3b_64h100.toml"))
    one = json.loads(
        _run(
            "rl", "estimate", str(EXAMPLES / "grpo_qwen3_30b_a3b_64h100.toml"), "--json",
            "--steps", "100",
        ).stdout
    )  # fmt: skip
    assert out.returncode == 0
    assert abs(one["run"]["hours"] - 100 * one["step_time_s"] / 3600) < 1e-9
    assert one["run"]["gpu_hours"] == one["run"]["hours"] * one["num_gpus"]
